#!/usr/bin/env bash
# The block cache's reuse predictor (PatchedServe §7) against the fixed threshold, on the trained
# models: trains one predictor per model (`gouache profile --reuse`, scenes of their own seed),
# then `gouache bench fidelity` at several thresholds and several predictor cut-offs, per image
# (orca) and per patch / token (patched over mixed sizes), each against the exact images of the
# same policy made in the same run. `gouache bench reuse-compare` reads the runs back and puts
# reuse and step time side by side at equal SSIM. Run nothing else meanwhile: the step ratios are
# of wall times.
#   bash benchmarks/reuse_predictor.sh [OUT_DIR] [PROMPTS]   (defaults: benchmarks/results/reuse, 48; about an hour)
set -euo pipefail
out=${1:-benchmarks/results/reuse}
prompts=${2:-48}
mixed=128x128,128x64,64x128,96x96
mkdir -p "$out"
gouache profile --reuse --model shapes-unet --requests 64 --sizes 64,96,128 --patch-size 32 \
  --out "$out/reuse_shapes-unet.json"
gouache profile --reuse --model shapes-dit --requests 64 --sizes 64,96,128 --out "$out/reuse_shapes-dit.json"
# instruction edits (a model that only edits profiles edits)
gouache profile --reuse --model shapes-edit --requests 64 --sizes 64,96,128 --out "$out/reuse_shapes-edit.json"
for model in shapes-unet shapes-dit shapes-edit; do
  for units in image part; do
    if [ "$units" = image ]; then
      setup=(--policy orca)
    elif [ "$model" = shapes-unet ]; then
      setup=(--policy patched --sizes "$mixed" --patch-size 32)
    else
      setup=(--policy patched --sizes "$mixed")
    fi
    for t in 0.02 0.03 0.05 0.1 0.2 0.3; do
      gouache bench fidelity --model "$model" --prompts "$prompts" "${setup[@]}" --step-repeats 2 \
        --candidate-block-cache "$t" --out "$out/${model}_${units}_threshold_$t.json"
    done
    for v in 0.3 0.5 0.7 0.9 0.97; do
      gouache bench fidelity --model "$model" --prompts "$prompts" "${setup[@]}" --step-repeats 2 \
        --candidate-block-cache "$v" --candidate-block-cache-predictor "$out/reuse_$model.json" \
        --out "$out/${model}_${units}_predictor_$v.json"
    done
  done
done
gouache bench reuse-compare "$out"
