#!/usr/bin/env bash
# The numbers only a GPU shows (issue 40), in parts that run one by one within a lease's time:
#   bash benchmarks/gpu.sh [OUT_DIR] [PART[:SECONDS]...]   (default OUT_DIR: benchmarks/results/gpu; PARTs: all, in order)
# A part given SECONDS is stopped after them (with its processes); what it wrote stays. A part that fails or
# is stopped does not stop the next; the script exits non-zero if any did.
# Parts, each file named after what it measures, the model and the GPU (e.g. edit_sd3-arch_h200.json):
#   fullsize-sdxl, fullsize-sd3, fullsize-flux: `gouache bench fullsize --device cuda` per model at 512 and
#       1024 px: mfu_ (bf16 step and MFU against the measured matmul peak), batching_ (patched/packed vs
#       grouped), edit_ (template edit at masks 0.1/0.2/0.5 vs full), lora_ (four adapters segmented and one
#       merged vs none), block_cache_ (a fixed half reused vs exact), controlnet_ (sdxl: the service sync
#       and async vs plain);
#   controlnet-sdxl: the controlnet_ rows alone;
#   quant-sdxl, quant-sd3, quant-flux: eager bf16 against its denoiser's linear layers in fp8 and int8 (torchao), step and
#       MFU at 512 and 1024 px, and the LoRA rows under each (quant_);
#   lora-sdxl, lora-sd3, lora-flux: the lora_ rows alone (segmented, per adapter, merged), and lora_loading_ (a
#       request whose adapter is read as it starts, synchronously and bounded-asynchronously);
#   blockcache-sdxl, blockcache-sd3, blockcache-flux: the block_cache_ rows alone;
#   park-sdxl, park-sd3, park-flux: a paused 1024 px request parked in host memory and stepped back (park_);
#   exactness: the engine-vs-diffusers exactness tests on the GPU in fp32 and bf16 (SECONDS each), their largest latent
#       differences in exactness_GPU.{json,md};
#   compile-sdxl, compile-sd3: compiled with CUDA graphs vs eager at 512 px, step and MFU (compile_; the
#       H200 took 2 min to compile sdxl-arch's 512 px graphs);
#   pieces-sd3, pieces-flux: packed forwards of mixed sizes in compiled pieces (CUDA graphs per piece, attention
#       eager between them) against eager and grouped compiled forwards, 512+1024 (pieces_; never run on a GPU yet);
#   pieces-sdxl: the patched UNet's graph, padded to its patch and image buckets under CUDA graphs (attention
#       between graph partitions), against the same (pieces_; never run on a GPU yet);
#   techniques-sdxl, techniques-sd3, techniques-flux: the template edit and block-cache rows, eager against
#       compiled with CUDA graphs (a UNet replay's graph, the layout as data, runs eagerly under CUDA graphs for
#       now; a DiT replay runs in the packed pieces, a CUDA graph each, the attention breaks eager; block-cache
#       pieces, a graph per block: techniques_; never run on a GPU yet);
#   batching-sdxl, batching-sd3: the bare denoisers' mixed-size forwards (`gouache bench batching`, denoiser_batching_);
#   profile-sdxl, profile-sd3: a cost model of the patched forward (`gouache profile --device cuda`), for
#       `gouache reproduce --only patchedserve` (costmodel_).
set -uo pipefail
out=${1:-benchmarks/results/gpu}
shift || true
parts=${*:-fullsize-sdxl fullsize-sd3 fullsize-flux exactness profile-sdxl compile-sdxl compile-sd3 pieces-sdxl pieces-sd3 pieces-flux techniques-sdxl techniques-sd3 techniques-flux batching-sdxl batching-sd3}
gpu=$(python3 -c "import re, torch; n = torch.cuda.get_device_name(); m = re.search(r'\b[A-Z]+[0-9]+\b', n)
print((m.group(0) if m else n.split()[-1]).lower())")
mkdir -p "$out"
gouache() { timeout --kill-after=10 "$limit" python3 -m gouache.cli "$@"; }
failed=
for spec in $parts; do
  part=${spec%%:*}
  limit=$([[ $spec == *:* ]] && echo "${spec#*:}" || echo 0)  # timeout's 0: no limit
  echo "== $part ($(date +%T), limit ${limit} s)" >&2
  model=${part#*-}-arch
  start=$SECONDS
  case $part in
    fullsize-*)
      gouache bench fullsize --device cuda --models "$model" --sizes 512,1024 --mixes 512+1024,512+768+1024 \
        --repeats 3 --out "$out/{section}_${model}_${gpu}.json" ;;
    controlnet-*)
      gouache bench fullsize --device cuda --models "$model" --sizes 512,1024 --skip mfu,patched,template,lora,lora_loading,block_cache,park \
        --repeats 5 --out "$out/{section}_${model}_${gpu}.json" ;;
    quant-*)
      gouache bench fullsize --device cuda --models "$model" --variants eager,fp8,int8 --sizes 512,1024 \
        --skip patched,template,lora_loading,block_cache,park,controlnet --repeats 3 --out "$out/quant_${model}_${gpu}.json" ;;
    lora-*)
      gouache bench fullsize --device cuda --models "$model" --sizes 512 --skip mfu,patched,template,block_cache,park,controlnet \
        --repeats 3 --out "$out/{section}_${model}_${gpu}.json" ;;
    blockcache-*)
      gouache bench fullsize --device cuda --models "$model" --sizes 512,1024 --mixes 512+1024 \
        --skip mfu,patched,template,lora,lora_loading,park,controlnet --repeats 3 --out "$out/{section}_${model}_${gpu}.json" ;;
    park-*)
      gouache bench fullsize --device cuda --models "$model" --sizes 1024 --skip mfu,patched,template,lora,lora_loading,block_cache,controlnet \
        --repeats 5 --out "$out/{section}_${model}_${gpu}.json" ;;
    compile-*)
      gouache bench fullsize --device cuda --models "$model" --variants eager,compiled --sizes 512 \
        --skip patched,template,lora,lora_loading,block_cache,park,controlnet --repeats 3 --out "$out/compile_${model}_${gpu}.json" ;;
    pieces-*)
      gouache bench fullsize --device cuda --models "$model" --variants eager,compiled --sizes 512,1024 --mixes 512+1024 \
        --skip mfu,template,lora,lora_loading,block_cache,park,controlnet --repeats 3 --out "$out/pieces_${model}_${gpu}.json" ;;
    techniques-*)
      gouache bench fullsize --device cuda --models "$model" --variants eager,compiled --sizes 512 --mixes 512+1024 \
        --skip mfu,patched,lora,lora_loading,park,controlnet --repeats 3 --out "$out/techniques_${model}_${gpu}.json" ;;
    exactness)
      xml=$(mktemp -d)
      for dtype in float32 bfloat16; do
        GOUACHE_TEST_DEVICE=cuda GOUACHE_TEST_DTYPE=$dtype timeout "$limit" python3 -m pytest -q -p no:cacheprovider \
          tests/engine/test_exactness.py --junitxml "$xml/$dtype.xml" || true
      done
      python3 benchmarks/exactness_table.py "$out/exactness_${gpu}.json" "$xml"/float32.xml "$xml"/bfloat16.xml ;;
    batching-*)
      gouache bench batching --model "$model" --device cuda --dtype bfloat16 --sizes 512,768,1024 --repeats 15 \
        --out "$out/denoiser_batching_${model}_${gpu}.json" ;;
    profile-*)
      gouache profile --model "$model" --device cuda --dtype bfloat16 --sizes 512,768,1024 --max-batch 4 --samples 30 \
        --repeats 2 --out "$out/costmodel_${model}_${gpu}.json" ;;
    *) echo "unknown part $part" >&2; exit 2 ;;
  esac
  status=$?
  echo "== $part: exit $status after $((SECONDS - start)) s" >&2
  [[ $status == 0 ]] || failed="$failed $part"
done
[[ -z $failed ]] || { echo "failed or stopped:$failed" >&2; exit 1; }
