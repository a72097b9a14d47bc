#!/usr/bin/env bash
# The numbers only a GPU shows, in one rerunnable command: step latency of mixed-size batches on the
# full-size architectures in bf16, in one forward (SDXL's UNet patched, SD3's MMDiT packed)
# against grouped by size (`gouache bench batching`). Files are named after the GPU, e.g. batching_sdxl-arch_h200.json.
#   bash benchmarks/gpu.sh [OUT_DIR]        (default OUT_DIR: benchmarks/results/gpu)
set -euo pipefail
out=${1:-benchmarks/results/gpu}
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name().split()[-1].lower())")
for model in sdxl-arch sd3-arch; do
  python3 -m gouache.cli bench batching --model "$model" --device cuda --dtype bfloat16 \
    --sizes 512,768,1024 --repeats 15 --out "$out/batching_${model}_${gpu}.json"
done
