#!/usr/bin/env bash
# The block cache's fidelity and speed on the trained models (`gouache bench fidelity`), at several
# thresholds: per image under orca (shapes-unet, shapes-dit, and shapes-edit's instruction edits); per
# patch (shapes-unet) and per token (shapes-dit, shapes-edit: its reference's tokens too) under patched
# over mixed sizes. Each run compares against the exact images of the same
# policy, made in the same run; step times are of one steady batch denoised by each setup in turn,
# 3 times (medians). Run nothing else meanwhile: the ratios are of wall times.
#   bash benchmarks/block_cache.sh [OUT_DIR] [PROMPTS]   (defaults: benchmarks/results/block_cache, 100)
set -euo pipefail
out=${1:-benchmarks/results/block_cache}
prompts=${2:-100}
mixed=128x128,128x64,64x128,96x96
for t in 0.05 0.1 0.2; do
  for model in shapes-unet shapes-dit shapes-edit; do
    gouache bench fidelity --model "$model" --prompts "$prompts" --candidate-block-cache "$t" \
      --out "$out/${model}_orca_t$t.json"
  done
  gouache bench fidelity --model shapes-unet --prompts "$prompts" --sizes "$mixed" --policy patched --patch-size 32 \
    --candidate-block-cache "$t" --out "$out/shapes-unet_patched_t$t.json"
  for model in shapes-dit shapes-edit; do
    gouache bench fidelity --model "$model" --prompts "$prompts" --sizes "$mixed" --policy patched \
      --candidate-block-cache "$t" --out "$out/${model}_patched_t$t.json"
  done
done
