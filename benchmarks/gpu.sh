#!/usr/bin/env bash
# The numbers only a GPU shows (issue 40), in parts that run one by one within a lease's time:
#   bash benchmarks/gpu.sh [OUT_DIR] [PART...]   (default OUT_DIR: benchmarks/results/gpu; PARTs: all, in order)
# Parts, each file named after what it measures, the model and the GPU (e.g. edit_sd3-arch_h200.json):
#   fullsize-sdxl, fullsize-sd3, fullsize-flux: `gouache bench fullsize --device cuda` per model at 512 and
#       1024 px: mfu_ (bf16 step and MFU against the measured matmul peak), batching_ (patched/packed vs
#       grouped), edit_ (template edit at masks 0.1/0.2/0.5 vs full), lora_ (four adapters segmented and one
#       merged vs none), block_cache_ (a fixed half reused vs exact), controlnet_ (sdxl: the service sync
#       and async vs plain);
#   exactness: the engine-vs-diffusers exactness tests on the GPU in fp32 and bf16, their largest latent
#       differences in exactness_GPU.{json,md};
#   compile-sdxl, compile-sd3: compiled with CUDA graphs vs eager, step and MFU (compile_);
#   batching-sdxl, batching-sd3: the bare denoisers' mixed-size forwards (`gouache bench batching`).
set -euo pipefail
out=${1:-benchmarks/results/gpu}
shift || true
parts=${*:-fullsize-sdxl fullsize-sd3 fullsize-flux exactness compile-sdxl compile-sd3 batching-sdxl batching-sd3}
gpu=$(python3 -c "import re, torch; n = torch.cuda.get_device_name(); m = re.search(r'\b[A-Z]+[0-9]+\b', n)
print((m.group(0) if m else n.split()[-1]).lower())")
mkdir -p "$out"
gouache() { python3 -m gouache.cli "$@"; }
for part in $parts; do
  echo "== $part ($(date +%T))" >&2
  model=${part#*-}-arch
  case $part in
    fullsize-*)
      gouache bench fullsize --device cuda --models "$model" --sizes 512,1024 --mixes 512+1024,512+768+1024 \
        --repeats 5 --out "$out/{section}_${model}_${gpu}.json" ;;
    compile-*)
      gouache bench fullsize --device cuda --models "$model" --variants eager,compiled --sizes 512,1024 \
        --skip patched,template,lora,block_cache,controlnet --repeats 5 --out "$out/compile_${model}_${gpu}.json" ;;
    exactness)
      xml=$(mktemp -d)
      for dtype in float32 bfloat16; do
        GOUACHE_TEST_DEVICE=cuda GOUACHE_TEST_DTYPE=$dtype python3 -m pytest -q -p no:cacheprovider \
          tests/engine/test_exactness.py --junitxml "$xml/$dtype.xml" || true
      done
      python3 benchmarks/exactness_table.py "$out/exactness_${gpu}.json" "$xml"/float32.xml "$xml"/bfloat16.xml ;;
    batching-*)
      gouache bench batching --model "$model" --device cuda --dtype bfloat16 --sizes 512,768,1024 --repeats 15 \
        --out "$out/batching_${model}_${gpu}.json" ;;
    *) echo "unknown part $part" >&2; exit 2 ;;
  esac
done
