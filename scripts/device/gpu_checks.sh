#!/usr/bin/env bash
# The GPU items of issues 64 and 63, in the order they matter, each under its own time
# limit. Each step writes into a work folder (GPU_CHECKS_WORK, /tmp/gpu-checks), packed
# after every step into OUT/gpu_checks.tar.gz beside OUT/steps.log: two files, since a
# call brings back at most 8 from OUT, and a cut-off call still brings back every step
# that finished. On a lent machine, after staging (README.md in this folder):
#   bash scripts/device/stage.sh bash scripts/device/gpu_checks.sh "$OUT"
# Each step's arguments can be overridden (THROUGHPUT_ARGS, RANKS_ARGS, DECODER_ARGS,
# FLOWER_ARGS, METHODS_ARGS, MAIN_ARGS, PAPER_ARGS), and STEPS picks some of them (default: all, in this order;
# their limits add up to more than a session's 15 minutes of device time, so a session
# with less left picks):
#   throughput  benchmarks/gpu_throughput.py with a profile of a cohort of 64 (issue 64, items 1-3)
#   ranks       benchmarks/distributed.py: 1, 2 and 4 ranks sharing the GPU (issue 63; 64 item 7)
#   decoder     benchmarks/decoders.py on a random 1B Llama-shaped decoder, bf16 and nf4 (64 item 4)
#   flower      benchmarks/decoders_vs_flower.py: that decoder's job, fedpeft against Flower's simulation (item 4)
#   methods     the decoder's job by PF2LoRA (bilevel) and HETLoRA (masked ranks), cohort_size auto (item 4)
#   main        the README's main job on the GPU, no flag (64 item 5)
#   paper       C2A's beta 0.1 setting at the paper's 100 rounds, one seed, five methods (64 item 6:
#               the C2A table is the seed paper already run on a GPU, so its tuned rates exist)
set -uo pipefail
dest=${1:?usage: gpu_checks.sh OUT}
out=${GPU_CHECKS_WORK:-/tmp/gpu-checks}
mkdir -p "$dest" "$out"
py=${PYTHON:-python3}
steps=${STEPS:-throughput ranks decoder flower methods main paper}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; git log -1 --format=%H; date -u; } \
  > "$out/machine.txt" 2>&1

step() {  # name, seconds, command...
  local name=$1 limit=$2
  shift 2
  echo "== $name (at most ${limit}s): $*" | tee -a "$out/steps.log"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$out/$name.txt" 2>&1
  echo "== $name: exit $? after $((SECONDS - t0))s" | tee -a "$out/steps.log"
  pack
}

pack() {  # everything so far into OUT
  tar -czf "$dest/gpu_checks.tar.gz.tmp" -C "$out" . && mv "$dest/gpu_checks.tar.gz.tmp" "$dest/gpu_checks.tar.gz"
  cp "$out/steps.log" "$dest/steps.log"
}

for s in $steps; do
  case $s in
    throughput) step throughput 300 $py benchmarks/gpu_throughput.py ${THROUGHPUT_ARGS:---profile 64} ;;
    ranks) step ranks 200 $py benchmarks/distributed.py \
      ${RANKS_ARGS:---ranks 1,2,4 --no-flower --clients 8 --rounds 3 --steps 10 --samples 1000} ;;
    decoder) step decoder 180 $py benchmarks/decoders.py \
      ${DECODER_ARGS:---backbone random-1b --length 512 --precisions bf16,nf4 --targets all-linear --work /tmp/decoders} ;;
    flower) step flower 240 $py benchmarks/decoders_vs_flower.py \
      ${FLOWER_ARGS:---backbone random-1b --length 512 --work /tmp/decoders} ;;
    methods) for m in pf2lora hetlora; do step "method-$m" 150 $py benchmarks/decoders_vs_flower.py --method $m \
      --only fedpeft-auto ${METHODS_ARGS:---backbone random-1b --length 512 --work /tmp/decoders}; done ;;
    main) step main 180 $py -m fedpeft run ${MAIN_ARGS:---set output_dir=/tmp/main-job}
      cp /tmp/main-job/metrics.jsonl "$out/main-metrics.jsonl" 2>/dev/null; pack ;;
    paper) step paper 240 $py benchmarks/c2a.py ${PAPER_ARGS:---betas 0.1 --rounds 100 --seeds 0 --no-ablation \
      --methods fedft,fedap,fedlr,fedbf,c2a --jobs 5 --out $out/c2a-100} ;;
    *) echo "unknown step $s" | tee -a "$out/steps.log" ;;
  esac
done
