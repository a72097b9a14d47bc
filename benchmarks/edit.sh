#!/usr/bin/env bash
# Mask-aware template edits (`gouache bench edit`): step and request latency vs mask ratio (from
# host memory and from a disk-only store), fidelity on the trained models (recolour edits; masked
# instruction edits on shapes-edit), and a Poisson edit load against fcfs-static regenerating in
# full. Sizes: the trained models at their own
# 128 px (and the DiT's largest, 256 px); tiny-flux at 256 px and at 1024 px, where image tokens
# outnumber text rows as in InstGenIE's setting, and tiny-flux-kontext at 1024 px (a masked
# edit's reference tokens replay too). Run nothing else meanwhile: the ratios are of wall times.
#   bash benchmarks/edit.sh [OUT_DIR]   (default: benchmarks/results/edit)
set -euo pipefail
out=${1:-benchmarks/results/edit}
gouache bench edit --model shapes-dit --size 128 --edits 24 --requests 24 --out "$out/edit_shapes-dit_128.json"
gouache bench edit --model shapes-unet --size 128 --edits 24 --requests 24 --out "$out/edit_shapes-unet_128.json"
gouache bench edit --model shapes-dit --size 256 --edits 12 --requests 0 --out "$out/edit_shapes-dit_256.json"
gouache bench edit --model shapes-edit --size 128 --edits 120 --requests 0 --out "$out/edit_shapes-edit_128.json"
gouache bench edit --model tiny-flux --size 256 --edits 0 --requests 24 --out "$out/edit_tiny-flux_256.json"
gouache bench edit --model tiny-flux --size 1024 --steps 4 --repeats 2 --edits 0 --requests 0 \
  --out "$out/edit_tiny-flux_1024.json"
gouache bench edit --model tiny-flux-kontext --size 1024 --steps 4 --repeats 2 --edits 4 --requests 0 \
  --out "$out/edit_tiny-flux-kontext_1024.json"
