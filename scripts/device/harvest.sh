#!/usr/bin/env bash
# On the device machine: run a benchmark command until LIMIT seconds have passed, then
# stop it. Every 15 s, and once more at the end, the records of every run that has
# finished meanwhile (config.yaml, metrics.jsonl, summary.json or diverged.json: what a
# benchmark re-reads) and the tuned files are packed into $OUT/records.tar.gz, so a call
# cut off by the device's time limit still brings back what finished; the command's
# output is $OUT/log. Unpack the archive in the checkout here, store its runs in their
# benchmark's file (python benchmarks/records.py convert RESULTS_DIR) and commit that and
# the tuned files; a cut-off run starts afresh next time.
#   bash scripts/device/harvest.sh LIMIT RESULTS_DIR command ...
set -uo pipefail
limit=$1 results=$2; shift 2
touch /tmp/harvest-start
# a run's directory once it has finished (summary.json) or diverged (diverged.json, a tuning run)
finished() { find "$results" \( -name summary.json -o -name diverged.json \) -newer /tmp/harvest-start -printf '%h\n'; }
pack() {  # written aside, then renamed: a kill mid-pack leaves the last whole archive
  local run f files=(benchmarks/tuned/*.json)
  mapfile -t done < <(finished)
  for run in "${done[@]}"; do
    for f in config.yaml metrics.jsonl summary.json diverged.json; do [ -f "$run/$f" ] && files+=("$run/$f"); done
  done
  tar -czf "$OUT/.records.tar.gz" "${files[@]}" && mv "$OUT/.records.tar.gz" "$OUT/records.tar.gz"
}
setsid "$@" > "$OUT/log" 2>&1 &  # its own process group: stopped with all its workers
pid=$!  # kept: pack's process substitution resets $!
start=$SECONDS
while [ $((SECONDS - start)) -lt "$limit" ] && kill -0 "$pid" 2>/dev/null; do
  nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader >> "$OUT/gpu.log"
  pack
  echo "$((SECONDS - start)) s: ${#done[@]} runs finished"
  sleep 15
done
kill -TERM -- "-$pid" 2>/dev/null; sleep 2
pack
echo "${#done[@]} runs finished"; tail -c 4000 "$OUT/log"
