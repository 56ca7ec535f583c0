#!/usr/bin/env bash
# The test suite (about 15 minutes on 2 cores). Long chaos/overload runs are opt-in: -m slow.
# Benchmarks and the soak are scripts under benchmarks/.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python -m pytest "$@"
