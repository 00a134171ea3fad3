#!/usr/bin/env bash
# A benchmark's rows on a lent GPU, at once: for each pair of values of two of its options
# (a method and a row, say), one process tunes that row (--tune) and then runs its table
# seeds (--jobs JOBS). Finished runs are reused (tuning.run_or_reuse), so a cut-off call
# loses only the runs in flight. Run it under harvest.sh (scripts/device/README.md):
#   bash scripts/device/chains.sh BENCHMARK OPTION_A VALUES_A OPTION_B VALUES_B [JOBS]
# e.g. the issue 34 privacy table, 36 chains:
#   bash scripts/device/stage.sh bash scripts/device/harvest.sh 480 benchmarks/results/privacy \
#     bash scripts/device/chains.sh privacy methods fedlr,ffalora,fedsb,pf2lora \
#       rows none-devices,clip-devices,user-1,user-3,user-8,none-silos,sample-1,sample-3,sample-8
# and issue 33's: chains.sh lora_family methods fedlr,federa,...,fedsb ranks equal,hetero
# CHAIN_ARGS (say "--rounds 1 --out /tmp/x --tuned-file /tmp/x.json") goes to every command.
set -u
[ $# -ge 5 ] || { sed -n '2,12p' "$0"; exit 2; }
bench=$1 opt_a=$2 values_a=$3 opt_b=$4 values_b=$5 jobs=${6:-3}
export OMP_NUM_THREADS=1
for a in ${values_a//,/ }; do
  for b in ${values_b//,/ }; do
    # shellcheck disable=SC2086  # CHAIN_ARGS: words
    (python3 "benchmarks/$bench.py" --tune "--$opt_a" "$a" "--$opt_b" "$b" ${CHAIN_ARGS:-} &&
      python3 "benchmarks/$bench.py" "--$opt_a" "$a" "--$opt_b" "$b" --jobs "$jobs" ${CHAIN_ARGS:-}) 2>&1 |
      sed -u "s/^/[$a $b] /" &
  done
done
wait
