#!/usr/bin/env bash
# LoRA serving (`gouache bench adapters`): the trained palette adapter of the shapes UNet (its
# loading bound from profile-lora, request latency with it uncached under synchronous and
# bounded asynchronous loading at emulated read times, what arriving at step K costs its effect),
# and a Poisson load over 50 random adapters (Zipf), mixed in one forward vs a forward per
# adapter. Run nothing else meanwhile: the ratios are of wall times.
#   bash benchmarks/adapters.sh [OUT_DIR]   (default: benchmarks/results/adapters)
set -euo pipefail
out=${1:-benchmarks/results/adapters}
gouache profile-lora --model shapes-unet --lora gouache/weights/loras/shapes-unet/palette.safetensors \
  --out "$out/lora_bound_shapes-unet_palette.json"
gouache bench adapters --model shapes-unet --fidelity 32 --requests 48 --out "$out/adapters_shapes-unet.json"
