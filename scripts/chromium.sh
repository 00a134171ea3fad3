#!/usr/bin/env bash
# Debian's Chromium, for the test that renders `fedpeft report --html` (pytest -m browser).
# Usage: bash scripts/chromium.sh     (nothing to do when a Chromium is on PATH)
set -euo pipefail
if command -v chromium >/dev/null || command -v chromium-browser >/dev/null; then
  exit 0
fi
echo "[setup] installing Chromium (Debian's package) for the HTML report's browser test"
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
$SUDO apt-get update -qq
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null
