"""Loading models and tokenizers from a local directory, and choosing device and dtype.

Everything here reads disk only: the server never downloads a model at run time.

An embedding model in bfloat16 is loaded *mixed*: the Linear layers' weights in bf16 (where
nearly all of the time goes), embeddings, LayerNorm, residual stream and pooling in fp32;
engine.embedding runs it under autocast. Measured on MiniLM (AMD EPYC, avx512_bf16, one
thread), it runs within a few percent of the whole model cast to bf16 (1.5-1.9x fp32) and stays
much closer to fp32: worst cosine 0.99998 vs 0.99993 on the bench's sentences, 0.99992 vs
0.99980 on 1-3-word inputs, where the cast falls below the 0.9999 bar (benchmarks/dtype_bench.py). `model.dtype: auto` decides between fp32
and that at start-up (engine.zygote, engine.embedding.probe_dtype): bf16 only where the
hardware has it natively, only if it holds `MIN_COSINE` against fp32 on a fixed probe set, and
only if it measures faster.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

NATIVE_BF16_ENV = "SELFTUNE_NATIVE_BF16"
"""`0` or `1` overrides the native-bf16 check (tests; a CPU whose flags are known to mislead)."""
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
MIN_COSINE = 0.9999
"""`dtype: auto` keeps bf16 only if every probe sentence's embedding is this close to fp32's."""
MIN_SPEEDUP = 1.1
"""... and only if its probe batch runs at least this much faster (a tie is not worth the error)."""


def decided_before_probe(requested: str, native: tuple[bool, str] | None, probe: dict | None, error: str | None) -> tuple[str, str] | None:
    """(dtype, reason) where `model.dtype` settles without the probe's numbers (forced, the probe
    failed, no native bf16, not probed), for every task's choice; None: the probe decides."""
    if requested != "auto":
        return requested, f"forced by model.dtype: {requested}"
    if error is not None:
        return "float32", f"the bf16 probe failed ({error})"
    if native is not None and not native[0]:
        return "float32", f"no native bf16 ({native[1]})"
    if probe is None:
        return "float32", "bf16 not probed"
    return None


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the front process needs to know about a model without loading its weights."""

    hidden_size: int
    max_length: int
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    vocab_size: int
    kv_values_per_token: int = 0
    """Causal LMs: numbers one token adds to the KV cache (layers × 2 × kv heads × head dim); 0 unknown."""
    kv_tokens: int | None = None
    """Generation: token slots a worker's KV cache may hold (model.kv_cache_mib at the loaded
    dtype), set once the dtype is known; None: no cap."""


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available on this machine")
    if device != "cpu" and not device.startswith("cuda"):
        raise ValueError(f"device={device!r}: expected auto, cpu, cuda or cuda:N")
    return device


def resolve_dtype(dtype: str, device: str):
    """float32 on CPU; bfloat16 on CUDA where supported, else float16; or what was asked."""
    import torch

    if dtype != "auto":
        try:
            return getattr(torch, dtype)
        except AttributeError:
            raise ValueError(f"dtype={dtype!r}: expected auto, float32, bfloat16 or float16") from None
    if device.startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def load_model(path: str, task: str, dtype):
    """The model on the CPU, in eval mode; a worker moves it to its device after the fork.

    An embedding model asked for in bfloat16 comes back mixed (`to_mixed_precision`); a
    generation model, or float16, is cast whole."""
    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    mixed = task == "embed" and dtype == torch.bfloat16
    cls = AutoModel if task == "embed" else AutoModelForCausalLM
    model = cls.from_pretrained(path, dtype=torch.float32 if mixed else dtype)
    model.eval()
    model.requires_grad_(False)
    return to_mixed_precision(model, dtype) if mixed else model


def to_mixed_precision(model, dtype):
    """The Linear layers' weights and biases in `dtype`, in place; everything else stays as it
    is (fp32). engine.embedding.EmbeddingRunner sees it (`compute_dtype`) and runs the forward
    under autocast, so each matmul runs in `dtype` and everything between them in fp32."""
    import torch

    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.to(dtype)
    return model


def compute_dtype(model):
    """The dtype the model's matmuls run in: its first Linear weight's (else its first parameter's)."""
    import torch

    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            return module.weight.dtype
    return next(model.parameters()).dtype


def cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU feature flags the kernel reports (the first processor's), empty if unreadable."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def native_bf16(device: str) -> tuple[bool, str]:
    """Whether `device` computes bf16 natively, and why we think so.

    CPU: avx512_bf16 or amx_bf16 in /proc/cpuinfo (without them bf16 is emulated and slower
    than fp32). CUDA: torch.cuda.is_bf16_supported(), which initialises CUDA: call it in a
    process that will not fork CUDA workers (the zygote's probe child, not the zygote).
    SELFTUNE_NATIVE_BF16=0/1 overrides both."""
    forced = os.environ.get(NATIVE_BF16_ENV, "").strip()
    if forced in ("0", "1"):
        return forced == "1", f"{NATIVE_BF16_ENV}={forced}"
    if device.startswith("cuda"):
        import torch

        ok = bool(torch.cuda.is_bf16_supported())
        return ok, "CUDA " + ("supports" if ok else "does not support") + " bf16"
    found = sorted(cpu_flags() & set(BF16_CPU_FLAGS))
    if found:
        return True, "CPU flags " + ",".join(found)
    return False, "no " + "/".join(BF16_CPU_FLAGS) + " in /proc/cpuinfo"


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def token_ids(tokenizer, texts: list[str]) -> list[list[int]]:
    """Each text's token ids, special tokens added, nothing truncated or padded.

    A fast tokenizer's Rust backend is called directly: transformers' `__call__` around it
    (argument checks, a BatchEncoding) costs as much CPU again per request, in the front
    process that shares the cores with the workers. The backend is used only while it has no
    truncation or padding set (transformers' own call clears both when asked for none).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.truncation is not None or backend.padding is not None:
        return tokenizer(texts, add_special_tokens=True, truncation=False, verbose=False)["input_ids"]
    # encode_batch_fast skips the character offsets nobody here reads, even for one text.
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
    return [encoding.ids for encoding in encode(texts, add_special_tokens=True)]


def model_info(path: str, tokenizer, task: str = "embed") -> ModelInfo:
    from transformers import AutoConfig, GenerationConfig

    config = AutoConfig.from_pretrained(path)
    check_task(config, task, path)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = getattr(text_config, "hidden_size", None) or getattr(text_config, "n_embd")
    limits = [
        getattr(text_config, name, None)
        for name in ("max_position_embeddings", "n_positions", "max_seq_len")
    ]
    tokenizer_limit = getattr(tokenizer, "model_max_length", None)
    if tokenizer_limit and tokenizer_limit < 1_000_000:
        limits.append(tokenizer_limit)
    max_length = min(x for x in limits if x) if any(limits) else 512
    eos = _eos_ids(path, config, tokenizer, GenerationConfig)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    vocab = getattr(text_config, "vocab_size", None) or len(tokenizer)
    return ModelInfo(
        hidden_size=int(hidden), max_length=int(max_length), eos_token_ids=eos, pad_token_id=int(pad), vocab_size=int(vocab),
        kv_values_per_token=_kv_values_per_token(text_config, int(hidden)),
    )


CAUSAL_LM_SUFFIXES = ("ForCausalLM", "LMHeadModel")
"""How transformers names the architectures `AutoModelForCausalLM` loads with their own head."""


def check_task(config, task: str, path: str) -> None:
    """A ValueError, before any worker starts, when `task` is generate and the model is not a
    causal LM: `AutoModelForCausalLM` would load an encoder (BERT) with a new, untrained head and
    serve noise. A config that names no architecture is let through (nothing to tell by)."""
    if task != "generate":
        return  # a decoder's mean-pooled states are embeddings too
    architectures = list(getattr(config, "architectures", None) or [])
    causal = any(a.endswith(CAUSAL_LM_SUFFIXES) for a in architectures) or (not architectures and getattr(config, "is_decoder", True))
    if causal and not getattr(config, "is_encoder_decoder", False):
        return
    raise ValueError(
        f"model at {path!r} ({', '.join(architectures) or config.model_type}) is not a causal language model, so it "
        f"cannot serve task: generate; serve it with --task embed, or give a model whose architecture ends in "
        f"{' or '.join(CAUSAL_LM_SUFFIXES)}"
    )


def _kv_values_per_token(config, hidden: int) -> int:
    """layers × 2 (keys, values) × kv heads × head dim, from Llama- or GPT-2-style config names."""
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None)
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    if not layers or not heads:
        return 0
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return int(layers) * 2 * int(kv_heads) * int(head_dim)


def _eos_ids(path, config, tokenizer, generation_config_cls) -> tuple[int, ...]:
    ids: list[int] = []
    try:
        gen = generation_config_cls.from_pretrained(path)
        ids += _as_list(gen.eos_token_id)
    except OSError:
        pass
    ids += _as_list(getattr(config, "eos_token_id", None))
    ids += _as_list(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(int(i) for i in ids))


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]
