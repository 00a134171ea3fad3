#!/usr/bin/env bash
# The committed records of every benchmark travel with each device call and count against
# its 64 MiB; by 2026-11-28 they alone passed it. Before a GPU session, park every results
# folder but the ones the session's benchmark reads: out of git's index and off the disk,
# into PARK_DIR (default /tmp/fedpeft-parked); after it, restore them as HEAD has them.
#   bash scripts/device/park.sh lora_family [more results folders to keep]
#   bash scripts/device/park.sh --restore
# Commit nothing while parked (the parked folders would read as deleted); restore first.
set -euo pipefail
cd "$(dirname "$0")/../.."
park=${PARK_DIR:-/tmp/fedpeft-parked}
if [ "${1:-}" = --restore ]; then
  for dir in "$park"/*; do
    [ -e "$dir" ] || continue
    name=$(basename "$dir")
    [ ! -e "benchmarks/results/$name" ] || { echo "benchmarks/results/$name exists: not overwritten" >&2; exit 1; }
    mv "$dir" "benchmarks/results/$name"
    git reset -q -- "benchmarks/results/$name"
  done
  git status --short | grep -v '^??' || echo "restored: the index is HEAD's again"
  exit 0
fi
[ $# -ge 1 ] || { sed -n '2,8p' "$0"; exit 2; }
mkdir -p "$park"
for dir in benchmarks/results/*/; do
  name=$(basename "$dir")
  [[ " $* " == *" $name "* ]] && continue
  git rm -r -q --cached -- "$dir"
  mv "$dir" "$park/$name"
done
echo "parked in $park: $(ls "$park" | tr '\n' ' ')"
