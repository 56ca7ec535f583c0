#!/usr/bin/env bash
# A user's install, checked end to end: build the wheel, install it into a fresh venv (torch
# pinned as in setup.sh), and from an empty directory serve, answer one embeddings request
# through the openai client, simulate with the packaged cost model, and run a quick bench.
# Any failure fails the script. About 3 minutes on 2 cores; .ci/run calls it.
#
#   ./scripts/wheel_smoke.sh            # with the checkout's .venv active (for the openai client)
#   SELFTUNE_SMOKE_BENCH=0 ./scripts/wheel_smoke.sh   # skip the bench step (~2.5 min)
set -euo pipefail
cd "$(dirname "$0")/.."
checkout=$(pwd)
client_python=$(command -v python)  # the checkout's venv: it has the openai client
work=$(mktemp -d)
server_pid=""
cleanup() {
    if [ -n "$server_pid" ] && kill -0 "$server_pid" 2>/dev/null; then kill -KILL "$server_pid" 2>/dev/null || true; fi
    rm -rf "$work"
}
trap cleanup EXIT
step() { echo "[wheel-smoke $(date +%T)] $*" >&2; }

step "building the wheel"
python -m pip wheel --no-deps -q -w "$work/dist" "$checkout"
wheel=$(ls "$work"/dist/selftune-*.whl)
step "installing $(basename "$wheel") into a fresh venv"
python3 -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q --upgrade pip
"$work/venv/bin/python" -m pip install -q "torch==${SELFTUNE_TORCH_VERSION:-2.13.0}"
"$work/venv/bin/python" -m pip install -q "$wheel"
selftune="$work/venv/bin/selftune"

mkdir "$work/empty" && cd "$work/empty"
step "selftune --version: $("$selftune" --version)"
"$selftune" config show > effective.yaml
grep -q "policy: builtin:default" effective.yaml

port=$("$client_python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
step "selftune serve on 127.0.0.1:$port (the packaged default config and policy)"
"$selftune" serve --port "$port" > serve.log 2>&1 &
server_pid=$!
for _ in $(seq 1 180); do
    if "$client_python" -c "import httpx, sys; sys.exit(httpx.get('http://127.0.0.1:$port/readyz').status_code != 200)" 2>/dev/null; then break; fi
    if ! kill -0 "$server_pid" 2>/dev/null; then cat serve.log >&2; echo "wheel-smoke: the server died" >&2; exit 1; fi
    sleep 1
done
"$client_python" - "$port" <<'EOF'
import sys

import openai

client = openai.OpenAI(base_url=f"http://127.0.0.1:{sys.argv[1]}/v1", api_key="unused")
vectors = client.embeddings.create(model="all-MiniLM-L6-v2", input=["hello world", "selftune"])
assert len(vectors.data) == 2 and len(vectors.data[0].embedding) == 384, vectors
print(f"[wheel-smoke] embeddings: 2 x {len(vectors.data[0].embedding)}", file=sys.stderr)
EOF
kill -TERM "$server_pid"
wait "$server_pid" || { cat serve.log >&2; echo "wheel-smoke: serve did not exit 0 on SIGTERM" >&2; exit 1; }
server_pid=""

step "selftune simulate with the packaged cost model"
"$selftune" simulate --workload "poisson:rate=5,duration=20" --json > simulate.out
tail -n 1 simulate.out | "$client_python" -c 'import json, sys; r = json.load(sys.stdin); assert r["completed"] > 0, r; print("[wheel-smoke] simulated", r["completed"], "requests", file=sys.stderr)'

if [ "${SELFTUNE_SMOKE_BENCH:-1}" != "0" ]; then
    step "selftune bench --quick --modes multiprocess --no-limit"
    "$selftune" bench --quick --modes multiprocess --no-limit --json > bench.out
    tail -n 1 bench.out | "$client_python" -c 'import json, sys; m = json.load(sys.stdin)["modes"][0]; assert m["max_qps"], m; print("[wheel-smoke] bench: multiprocess max QPS", m["max_qps"], file=sys.stderr)'
fi
step "passed"
