#!/usr/bin/env bash
# Issue 34's compression runs on a lent GPU, at once: each (method, codec) row's tuning
# chain followed by its own table runs. Finished runs are reused (tuning.run_or_reuse),
# so a cut-off call loses only the runs in flight. Run it under harvest.sh:
#   bash scripts/device/stage.sh bash scripts/device/harvest.sh 270 benchmarks/results/compression \
#     bash scripts/device/compression_all.sh
set -u
export OMP_NUM_THREADS=1
for method in fedlr federa; do
  for row in none fp16 bf16 int8 nf4 topk10 topk1 randk10 int8both; do
    (python3 benchmarks/compression.py --tune --methods $method --rows $row &&
      python3 benchmarks/compression.py --methods $method --rows $row --jobs 3) 2>&1 |
      sed -u "s/^/[$method-$row] /" &
  done
done
wait
