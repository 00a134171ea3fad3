#!/usr/bin/env bash
# The test suite: set up (if needed), then pytest. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# One worker per core; a test module stays on one worker (the deployment tests share one
# federation per module).
exec .venv/bin/python -m pytest -n auto --dist loadscope "$@"
