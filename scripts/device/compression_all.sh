#!/usr/bin/env bash
# Issue 34's compression runs on a lent GPU, at once: each (method, codec) row's tuning
# chain followed by its own table runs (chains.sh). Run it under harvest.sh:
#   bash scripts/device/stage.sh bash scripts/device/harvest.sh 270 benchmarks/results/compression \
#     bash scripts/device/compression_all.sh
exec bash "$(dirname "$0")/chains.sh" compression methods fedlr,federa \
  rows none,fp16,bf16,int8,nf4,topk10,topk1,randk10,int8both 3
