"""The engine on CUDA: placement, two workers on one GPU, NVML sampling, embeddings, generation.

Marked `gpu`: `pytest -m gpu tests/test_gpu.py` (scripts/gpu_check.py runs exactly that). Every
test skips without CUDA. Real worker processes and the real models; the references are computed
on the CPU in this process. GPUs are matched to NVML's readings by UUID.
"""

from __future__ import annotations

import dataclasses
import os
import time

import numpy as np
import pytest
import torch

from engine.config import EngineConfig, Knobs
from engine.engine import Engine
from engine.model_source import resolve_model
from engine.placement import GpuSlot, affinity_topology
from engine.sampling import SamplingParams
from monitors.gpu import GpuMonitor

# Before CUDA starts here or in the engines' workers (they inherit it): cuda:N is then the GPU
# NVML calls N, as the planner's indices (from NVML) assume.
os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason=f"needs CUDA: torch {torch.__version__} (built with CUDA {torch.version.cuda}) sees no GPU"),
]

TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog.", "What is the capital of France?", "a",
         "Embeddings map sentences to vectors; similar sentences land close together. " * 6,
         "GPUs run many small matrix products at once."] + [f"sentence {i} about topic {i % 3} " * (1 + i % 4) for i in range(10)]
PROMPTS = ["1, 2, 3, 4, 5,", "The capital of France is", "The largest planet in the solar system is"]
GREEDY_TOKENS = 16
MIB = 2**20


@pytest.fixture(scope="module")
def monitor():
    gpu = GpuMonitor()
    yield gpu
    gpu.close()


@pytest.fixture(scope="module")
def topology():
    """This process's CPUs, and every CUDA device as a GPU (node unknown)."""
    return dataclasses.replace(affinity_topology(), gpus=tuple(GpuSlot(i, None) for i in range(torch.cuda.device_count())))


@pytest.fixture(scope="module")
def cpu_vectors() -> np.ndarray:
    from transformers import AutoModel, AutoTokenizer

    path = resolve_model("builtin:minilm", EngineConfig().cache_dir).path
    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    with torch.inference_mode():
        hidden = model(**batch).last_hidden_state
    weights = batch["attention_mask"].unsqueeze(-1).float()
    return torch.nn.functional.normalize((hidden * weights).sum(1) / weights.sum(1), dim=1).numpy()


def nvml_index(cuda_index: int, report) -> int:
    """NVML's index of CUDA device `cuda_index`, by UUID (index order when UUIDs are not given)."""
    uuid = str(getattr(torch.cuda.get_device_properties(cuda_index), "uuid", "")).lower().removeprefix("gpu-")
    for device in report.devices:
        if uuid and (device.uuid or "").lower().removeprefix("gpu-") == uuid:
            return device.index
    return cuda_index


def memory_used(monitor) -> dict[int, int]:
    return {d.index: d.memory_used_bytes or 0 for d in monitor.sample(time.monotonic()).devices}


def maps_libcuda(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "libcuda" in f.read()


def start_engine(topology, workers: int, workers_per_gpu: int, dtype: str = "float32", **changes) -> Engine:
    config = EngineConfig(model="builtin:minilm", device="cuda", dtype=dtype, workers_per_gpu=workers_per_gpu, topology=topology,
                          knobs=Knobs(process_count=workers, max_batch_size=16, batch_timeout=0.002), **changes)
    engine = Engine(config).start(ready_timeout=40)  # short: a worker that cannot use CUDA must not eat the budget
    try:
        engine.wait_ready(30, workers=workers)
    except BaseException:
        engine.shutdown(grace=0)
        raise
    return engine


def embed_all(engine: Engine) -> np.ndarray:
    futures = [engine.embed(TEXTS[i:i + 2]) for i in range(0, len(TEXTS), 2)]
    return np.concatenate([f.result(timeout=60).vectors for f in futures])


def workers_and_plan(engine: Engine) -> list[tuple[int, int | None]]:
    """(pid, planned GPU) per active worker, in the order the plan's slots are taken."""
    stats = engine.stats()
    workers = sorted(stats.workers, key=lambda w: w.worker_id)
    return [(w.pid, p["gpu"]) for w, p in zip(workers, stats.placement["workers"])]


def assert_on_planned_gpus(monitor, pairs, before: dict[int, int], min_rise: int) -> None:
    """Each worker mapped the CUDA driver; each planned GPU's memory rose by `min_rise` per
    worker on it; and where NVML lists the workers' pids (not inside every PID namespace),
    each sits on its planned GPU."""
    report = monitor.sample(time.monotonic())
    after = {d.index: d.memory_used_bytes or 0 for d in report.devices}
    for pid, gpu in pairs:
        assert maps_libcuda(pid), f"worker {pid} never loaded the CUDA driver"
    for gpu in {g for _, g in pairs}:
        index = nvml_index(gpu, report)
        count = sum(g == gpu for _, g in pairs)
        rise = after[index] - before.get(index, 0)
        assert rise >= count * min_rise, f"GPU {gpu}: memory rose {rise / MIB:.0f} MiB for {count} worker(s)"
    listed = {pid: d.index for d in report.devices for pid in d.processes}
    for pid, gpu in pairs:
        if pid in listed:
            assert listed[pid] == nvml_index(gpu, report), f"worker {pid} runs on NVML GPU {listed[pid]}, planned {gpu}"


def test_nvml_sampling_reads_live_figures(monitor):
    report = monitor.sample(time.monotonic())
    assert report.unavailable_reason is None and len(report.devices) >= torch.cuda.device_count()
    for device in report.devices:
        assert device.name and device.memory_total_bytes > 0 and device.memory_used_bytes is not None
        assert device.power_watts is not None and device.power_watts > 0
    index = nvml_index(0, report)
    used = memory_used(monitor)[index]
    dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    a = torch.randn(8192, 8192, device="cuda:0", dtype=dtype)
    block = torch.empty(256 * MIB, dtype=torch.uint8, device="cuda:0")  # noqa: F841 - held for the reading
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        a @ a
    torch.cuda.synchronize()
    per_product = (time.perf_counter() - t0) / 10
    for _ in range(max(20, int(2.0 / per_product))):  # about 2 s of queued work
        a @ a
    readings = []
    for _ in range(5):
        time.sleep(0.3)
        readings.append(monitor.sample(time.monotonic()).devices[index])
    torch.cuda.synchronize()
    assert max(r.utilization_gpu or 0 for r in readings) > 0, "NVML utilisation stayed 0 while the GPU multiplied"
    assert max(r.memory_used_bytes for r in readings) - used >= 256 * MIB
    del a, block
    torch.cuda.empty_cache()


def test_workers_land_on_the_gpus_the_plan_gives(topology, monitor, cpu_vectors):
    """One worker per GPU (up to 4), with the shipped default dtype (auto)."""
    count = min(4, torch.cuda.device_count())
    before = memory_used(monitor)
    engine = start_engine(topology, workers=count, workers_per_gpu=1, dtype="auto")
    try:
        pairs = workers_and_plan(engine)
        assert [gpu for _, gpu in pairs] == list(range(count))
        vectors = embed_all(engine)
        assert_on_planned_gpus(monitor, pairs, before, min_rise=64 * MIB)
    finally:
        engine.shutdown()
    assert float(np.min(np.sum(vectors * cpu_vectors, axis=1))) >= 0.999


@pytest.fixture(scope="module")
def shared_gpu_engine(topology, monitor):
    before = memory_used(monitor)
    engine = start_engine(topology, workers=2, workers_per_gpu=2)
    yield engine, before
    engine.shutdown()


def test_two_workers_share_one_gpu(shared_gpu_engine, monitor):
    engine, before = shared_gpu_engine
    pairs = workers_and_plan(engine)
    assert [gpu for _, gpu in pairs] == [0, 0]
    futures = [engine.embed(TEXTS) for _ in range(40)]
    for f in futures:
        f.result(timeout=60)
    assert all(w.batches > 0 for w in engine.stats().workers), "both workers on the GPU should have run batches"
    assert_on_planned_gpus(monitor, pairs, before, min_rise=64 * MIB)


def test_embeddings_on_cuda_match_the_cpu(shared_gpu_engine, cpu_vectors):
    engine, _ = shared_gpu_engine
    assert engine.device.startswith("cuda") and engine.dtype == "float32"
    cosines = np.sum(embed_all(engine) * cpu_vectors, axis=1)
    assert float(cosines.min()) >= 0.999, f"cosines against the CPU: {np.round(cosines, 6).tolist()}"


def cpu_greedy(path: str, prompts: list[str]) -> dict[str, list[int]]:
    """Greedy tokens by full recomputation at float32 on the CPU, the EOS ignored."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = {}
    with torch.inference_mode():
        for prompt in prompts:
            ids = tokenizer(prompt)["input_ids"]
            for _ in range(GREEDY_TOKENS):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            out[prompt] = ids[-GREEDY_TOKENS:]
    return out


def test_generation_on_cuda_is_greedy_equal_to_the_cpu(topology):
    path = resolve_model("builtin:smollm2", EngineConfig().cache_dir).path
    config = EngineConfig(model="builtin:smollm2", task="generate", device="cuda", dtype="float32", topology=topology,
                          knobs=Knobs(process_count=1, max_batch_size=4))
    engine = Engine(config).start(ready_timeout=40)
    try:
        assert engine.stats().placement["workers"][0]["gpu"] == 0
        params = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0, ignore_eos=True)
        streams = [engine.generate(prompt, params) for prompt in PROMPTS]  # at once: batched decoding
        served = {prompt: [event.token_id for event in stream] for prompt, stream in zip(PROMPTS, streams)}
    finally:
        engine.shutdown()
    expected = cpu_greedy(path, PROMPTS)
    for prompt in PROMPTS:
        assert served[prompt] == expected[prompt], f"{prompt!r}: served {served[prompt]} != CPU {expected[prompt]}"
