#!/usr/bin/env bash
# LoRA serving (`gouache bench adapters`): the trained palette adapters of the shapes UNet and of
# shapes-edit, the instruction-edit model (each one's loading bound from profile-lora, request
# latency with it uncached under synchronous and bounded asynchronous loading at emulated read
# times, what arriving at step K costs its effect), and a Poisson load over 50 random adapters
# (Zipf), mixed in one forward vs a forward per adapter. Run nothing else meanwhile: the ratios are of wall times.
#   bash benchmarks/adapters.sh [OUT_DIR]   (default: benchmarks/results/adapters)
set -euo pipefail
out=${1:-benchmarks/results/adapters}
gouache profile-lora --model shapes-unet --lora gouache/weights/loras/shapes-unet/palette.safetensors \
  --out "$out/lora_bound_shapes-unet_palette.json"
gouache bench adapters --model shapes-unet --fidelity 32 --requests 48 --out "$out/adapters_shapes-unet.json"
gouache profile-lora --model shapes-edit --lora gouache/weights/loras/shapes-edit/palette.safetensors \
  --out "$out/lora_bound_shapes-edit_palette.json"
gouache bench adapters --model shapes-edit --fidelity 40 --requests 24 --out "$out/adapters_shapes-edit.json"
