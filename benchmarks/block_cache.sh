#!/usr/bin/env bash
# The block cache's fidelity and speed on the trained models (`gouache bench fidelity`), at several
# thresholds: per image under orca (shapes-unet, shapes-dit), per patch under patched over mixed sizes
# (shapes-unet). Each run compares against the exact images of the same policy, made in the same run.
#   bash benchmarks/block_cache.sh [OUT_DIR] [PROMPTS]   (defaults: benchmarks/results/block_cache, 100)
set -euo pipefail
out=${1:-benchmarks/results/block_cache}
prompts=${2:-100}
for t in 0.05 0.1 0.2; do
  gouache bench fidelity --model shapes-unet --prompts "$prompts" --candidate-block-cache "$t" \
    --out "$out/shapes-unet_orca_t$t.json"
  gouache bench fidelity --model shapes-unet --prompts "$prompts" --sizes 128x128,128x64,64x128,96x96 \
    --policy patched --patch-size 32 --candidate-block-cache "$t" --out "$out/shapes-unet_patched_t$t.json"
  gouache bench fidelity --model shapes-dit --prompts "$prompts" --candidate-block-cache "$t" \
    --out "$out/shapes-dit_orca_t$t.json"
done
