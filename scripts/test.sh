#!/usr/bin/env bash
# The test suite: set up (if needed), then pytest. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# One worker per core, tests dealt out one by one; a deployment module's tests stay on one
# worker (marked xdist_group: they share one federation).
exec .venv/bin/python -m pytest -n auto --dist loadgroup "$@"
