#!/usr/bin/env bash
# ControlNets (`gouache bench fidelity --controlnet`): the shapes UNet's trained layout ControlNet
# places each prompt's shapes (captions without positions); its residuals a step late (async, on
# the ControlNet service) against the same step (sync): SSIM and the checker's agreement with
# the layout; and the same captions without the ControlNet, what it adds. The latency of
# ControlNet and LoRA workflow mixes is in benchmarks/adapters.sh (and below, one thread per
# process). Run nothing else meanwhile.
#   bash benchmarks/controlnet.sh [OUT_DIR]   (default: benchmarks/results/controlnet)
set -euo pipefail
out=${1:-benchmarks/results/controlnet}
gouache bench fidelity --controlnet layout --candidate-controlnet-mode async --prompts 32 --out "$out/fidelity_async.json"
gouache bench fidelity --controlnet layout --candidate-controlnet-mode none --prompts 32 --out "$out/fidelity_none.json"
# the workflow mixes with one thread per process: the base model's and each ControlNet worker's
# own core, as KATZ gives each its own GPU (benchmarks/adapters.sh runs them at torch's default)
gouache bench adapters --torch-threads 1 --fidelity 0 --requests 0 --out "$out/workflows_threads1.json"
