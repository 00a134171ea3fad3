#!/usr/bin/env bash
# Issue 32's runs on a lent GPU, at once: each tuning chain (a row of FeDeRA on the
# Dirichlet split, FedLR's SCAFFOLD, each robust aggregator) followed by its own table
# runs, beside the table runs of the rows tuned already. Finished runs are reused
# (tuning.run_or_reuse), so a cut-off call loses only the runs in flight. Run it under
# harvest.sh (scripts/device/README.md):
#   bash scripts/device/stage.sh bash scripts/device/harvest.sh 480 benchmarks/results/server_opt \
#     bash scripts/device/server_opt_all.sh
set -u
export OMP_NUM_THREADS=1
so() { python3 benchmarks/server_opt.py "$@"; }
chain() {  # NAME COMMAND...: its output, each line prefixed with NAME
  local name=$1; shift
  ("$@") 2>&1 | sed -u "s/^/[$name] /"
}
tuned_rows=fedavg,fedavgm,fedadam,fedyogi,fedadagrad,fedprox,fedavg_sgd
chain table so --methods fedlr --splits dirichlet --rows "$tuned_rows" --jobs 3 &&
  chain table so --methods federa --splits dirichlet --rows fedavg --jobs 3 &&
  chain table so --methods fedlr,federa --splits natural --jobs 3 &
for row in fedavgm fedadam fedyogi fedadagrad fedprox fedavg_sgd scaffold; do
  chain "federa-$row" bash -c "python3 benchmarks/server_opt.py --tune --methods federa --splits dirichlet --rows $row &&
    python3 benchmarks/server_opt.py --methods federa --splits dirichlet --rows $row --jobs 2" &
done
chain fedlr-scaffold bash -c "python3 benchmarks/server_opt.py --tune --methods fedlr --splits dirichlet --rows scaffold --extend 4 &&
  python3 benchmarks/server_opt.py --methods fedlr --splits dirichlet --rows scaffold --jobs 2" &
(
  for rule in median trimmed_mean krum multi_krum; do
    chain "robust-$rule" so --tune --robust --aggregators "$rule" &
  done
  wait
  chain robust so --robust --jobs 6
) &
wait
