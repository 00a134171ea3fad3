#!/usr/bin/env bash
# The main job: set up (if needed), then run an experiment.
# Usage: bash scripts/run.sh [CONFIG.yaml] [fedpeft run options]   (no config: the default experiment)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/fedpeft run "$@"
