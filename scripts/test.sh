#!/usr/bin/env bash
# The test suite (about 5 minutes on 2 cores). Benchmarks and soak runs are opt-in: -m bench / -m slow.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python -m pytest "$@"
