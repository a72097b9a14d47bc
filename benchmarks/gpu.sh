#!/usr/bin/env bash
# The numbers only a GPU shows (issues 40, 62), in parts that run one by one within a lease's time:
#   bash benchmarks/gpu.sh [--quick] [--print] [OUT_DIR] [PART[:SECONDS]...]
#     (default OUT_DIR: benchmarks/results/gpu; PARTs: issue 62's, in the order of their value)
# --quick runs the same commands on this machine's CPU with the tiny models (tiny-sdxl for sdxl-arch, ...), their
# smallest sizes, one repeat, compiled variants through the eager backend (no kernels generated): a smoke run of
# every part before a lease (tests/bench/test_gpu_script.py); its files are named after the cpu. --print writes
# each part's commands, one a line, instead of running them (what a lease would run; the test parses them).
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
#   quantcompiled-sdxl, quantcompiled-sd3, quantcompiled-flux: bf16, fp8 and int8 compiled under CUDA graphs against
#       eager bf16, one request's step at 1024 px and its MFU (quant_cudagraphs_);
#   lora-sdxl, lora-sd3, lora-flux: the lora_ rows alone (segmented, per adapter, merged), and lora_loading_ (a
#       request whose adapter is read as it starts, synchronously and bounded-asynchronously);
#   blockcache-sdxl, blockcache-sd3, blockcache-flux: the block_cache_ rows alone;
#   park-sdxl, park-sd3, park-flux: a paused 1024 px request parked in host memory and stepped back (park_);
#   gputests: the tests marked gpu (`pytest -m gpu`: the compiled pieces under CUDA graphs against eager), whose
#       JUnit XML is gputests_GPU.xml;
#   exactness: the engine-vs-diffusers exactness tests on the GPU in fp32 and bf16 (SECONDS each), their largest latent
#       differences in exactness_GPU.{json,md};
#   compile-sdxl, compile-sd3: compiled with CUDA graphs vs eager at 512 px, step and MFU (compile_; the
#       H200 took 2 min to compile sdxl-arch's 512 px graphs);
#   cudagraphs-SECTION-MODEL (issue 62's first part): one section, eager against compiled with CUDA graphs, in a
#       process of its own compiling only the graphs that section steps at ({section}_cudagraphs_): mfu (step and
#       MFU, 512 and 1024 px), batching (patched UNet or packed DiT over grouped, 512+1024; a DiT's packed forward in
#       pieces, a CUDA graph each, attention eager between them), edit (template over full at 1024 px, masks
#       0.1/0.2/0.5; a DiT's replay in the pieces), lora (four adapters segmented, per adapter and merged over
#       none, rank 16 and 64, 512 px), blockcache (a fixed half reused per image at 1024 px and per patch or token
#       over 512+1024; a UNet's cached blocks in pieces, a DiT's eager);
#   batching-sdxl, batching-sd3: the bare denoisers' mixed-size forwards (`gouache bench batching`, denoiser_batching_);
#   profile-sdxl, profile-sd3: a cost model of the patched forward (`gouache profile --device cuda`), for
#       `gouache reproduce --only patchedserve` (costmodel_);
#   profile-compiled-sd3, profile-compiled-flux, ...: the same of compiled steps under CUDA graphs at 512 and 1024 px
#       (costmodel_compiled_; issue 62's third part: `gouache reproduce --only patchedserve --batching-costs` with it);
#   baselines-flux, ...: end to end against what users run (`gouache bench baselines`, bf16, 512 and 1024 px, a burst
#       of 12 and 60 s of Poisson arrivals at 0.3/s): a diffusers pipeline one request at a time and with static
#       batching, against gouache compiled under CUDA graphs with patched-slo and profile-compiled-MODEL's cost
#       model (run that part first) (baselines_).
set -uo pipefail
quick=false print=false
while [[ ${1:-} == --* ]]; do
  case $1 in
    --quick) quick=true ;;
    --print) print=true ;;
    *) echo "unknown option $1 (--quick, --print)" >&2; exit 2 ;;
  esac
  shift
done
out=${1:-benchmarks/results/gpu}
shift || true
# by default, in the order of issue 62's value (docs/fullsize.md, the fourth lease: sized there from its compile times)
parts=${*:-gputests cudagraphs-edit-sd3 cudagraphs-batching-sd3 cudagraphs-lora-flux cudagraphs-edit-flux cudagraphs-mfu-flux
  cudagraphs-mfu-sd3 profile-compiled-flux baselines-flux cudagraphs-batching-flux cudagraphs-lora-sdxl
  cudagraphs-blockcache-sdxl lora-flux lora-sdxl quantcompiled-flux exactness}
if $quick; then
  gpu=cpu device=cpu
  # the tiny models' sizes (bench fullsize --quick's own: 128, 256, 128+256) and a single repeat
  sizes() { :; }
elif $print; then
  gpu=GPU device=cuda
  sizes() { echo "$@"; }
else
  gpu=$(python3 -c "import re, torch; n = torch.cuda.get_device_name(); m = re.search(r'\b[A-Z]+[0-9]+\b', n)
print((m.group(0) if m else n.split()[-1]).lower())")
  device=cuda
  sizes() { echo "$@"; }
fi
$print || mkdir -p "$out"
# a part's command, stopped after its limit; --print: written out instead, one line each
run() { if $print; then printf '%q ' "$@"; echo; else timeout --kill-after=10 "$limit" "$@"; fi; }
gouache() { run python3 -m gouache.cli "$@"; }
# bench fullsize with the part's sizes (--quick: the bench's own, and compiled variants through dynamo's eager
# backend: no kernels generated), on the device
fullsize() {
  local quick_args=()
  $quick && quick_args=(--quick $([[ " $* " == *compiled* ]] && echo --compile-backend eager))
  gouache bench fullsize --device "$device" --models "$model" "${quick_args[@]}" "$@"
}
# --skip's list of every section of bench fullsize but $1
all_but() { local all=,mfu,patched,template,lora,lora_loading,block_cache,park,controlnet,ulysses,; all=${all/,$1,/,}; all=${all#,}; echo "${all%,}"; }
failed=
for spec in $parts; do
  part=${spec%%:*}
  limit=$([[ $spec == *:* ]] && echo "${spec#*:}" || echo 0)  # timeout's 0: no limit
  echo "== $part ($(date +%T), limit ${limit} s)" >&2
  model=${part##*-}-arch  # the part's last word: sdxl, sd3, flux
  name=$model
  $quick && model=tiny-${part##*-}
  start=$SECONDS
  case $part in
    cudagraphs-*)
      section=${part#cudagraphs-}
      section=${section%-*}
      # each section's graphs (--compile-graphs): a row graph per size and row bucket, then a DiT's packed
      # pieces (batching: one range per row bucket) or replays (edit: four buckets of computed tokens), or a
      # patched UNet's (sdxl batching and blockcache); none beyond the rows where the section runs none
      case $section in
        mfu) only=mfu graphs=2; at=(--sizes 512,1024) ;;
        batching) only=patched graphs=6; at=(--sizes 512,1024 --mixes 512+1024) ;;
        edit) only=template graphs=5; at=(--sizes 1024 --masks 0.1,0.2,0.5) ;;
        lora) only=lora graphs=2; at=(--sizes 512 --ranks 16,64) ;;
        blockcache) only=block_cache graphs=$([[ $name == sdxl-arch ]] && echo 6 || echo 4); at=(--sizes 1024 --mixes 512+1024) ;;
        *) echo "unknown section $section in $part" >&2; exit 2 ;;
      esac
      fullsize --variants eager,compiled $(sizes "${at[@]}" --repeats 3) --skip "$(all_but "$only")" --compile-graphs "$graphs" \
        --out "$out/{section}_cudagraphs_${name}_${gpu}.json" ;;
    fullsize-*)
      fullsize $(sizes --sizes 512,1024 --mixes 512+1024,512+768+1024 --repeats 3) \
        --out "$out/{section}_${name}_${gpu}.json" ;;
    controlnet-*)
      fullsize $(sizes --sizes 512,1024 --repeats 5) --skip mfu,patched,template,lora,lora_loading,block_cache,park \
        --out "$out/{section}_${name}_${gpu}.json" ;;
    quant-*)
      $quick && variants=eager,int8 || variants=eager,fp8,int8  # fp8 needs a GPU
      fullsize --variants "$variants" $(sizes --sizes 512,1024 --repeats 3) \
        --skip patched,template,lora_loading,block_cache,park,controlnet --out "$out/quant_${name}_${gpu}.json" ;;
    quantcompiled-*)  # issue 62's fp8 and int8 under compile, against bf16 compiled: one size's step, a graph each
      $quick && variants=eager,compiled,compiled+int8 || variants=eager,compiled,compiled+fp8,compiled+int8
      fullsize --variants "$variants" $(sizes --sizes 1024 --repeats 3) --skip "$(all_but mfu)" --compile-graphs 1 \
        --out "$out/quant_cudagraphs_${name}_${gpu}.json" ;;
    lora-*)
      fullsize $(sizes --sizes 512 --repeats 3) --skip mfu,patched,template,block_cache,park,controlnet \
        --out "$out/{section}_${name}_${gpu}.json" ;;
    blockcache-*)
      fullsize $(sizes --sizes 512,1024 --mixes 512+1024 --repeats 3) \
        --skip mfu,patched,template,lora,lora_loading,park,controlnet --out "$out/{section}_${name}_${gpu}.json" ;;
    park-*)
      fullsize $(sizes --sizes 1024 --repeats 5) --skip mfu,patched,template,lora,lora_loading,block_cache,controlnet \
        --out "$out/{section}_${name}_${gpu}.json" ;;
    compile-*)
      fullsize --variants eager,compiled $(sizes --sizes 512 --repeats 3) \
        --skip patched,template,lora,lora_loading,block_cache,park,controlnet --out "$out/compile_${name}_${gpu}.json" ;;
    gputests)
      run python3 -m pytest -q -p no:cacheprovider -m gpu $(grep -rl "mark.gpu" tests/) \
        --junitxml "$out/gputests_${gpu}.xml" ;;
    exactness)
      xml=$($print && echo "$out/xml" || mktemp -d)
      # --quick: one family's cases in fp32, as a check that the table is written
      $quick && { dtypes=float32; select=(-k "tiny-sd3 and orca"); } || { dtypes="float32 bfloat16"; select=(); }
      for dtype in $dtypes; do
        run env GOUACHE_TEST_DEVICE=$device GOUACHE_TEST_DTYPE=$dtype python3 -m pytest -q -p no:cacheprovider \
          tests/engine/test_exactness.py "${select[@]}" --junitxml "$xml/$dtype.xml" || true
      done
      run python3 benchmarks/exactness_table.py "$out/exactness_${gpu}.json" "$xml"/*.xml ;;
    batching-*)
      gouache bench batching --model "$model" --device "$device" --dtype bfloat16 \
        $($quick && echo "--sizes 128,192,256 --mixes SML,4S --repeats 1" || echo "--sizes 512,768,1024 --repeats 15") \
        --out "$out/denoiser_batching_${name}_${gpu}.json" ;;
    profile-compiled-*)
      gouache profile --model "$model" --device "$device" --dtype bfloat16 --compile \
        $($quick && echo "--sizes 128,192 --max-batch 2 --samples 4 --repeats 1 --compile-backend eager --compile-graphs 6" \
          || echo "--sizes 512,1024 --max-batch 2 --samples 12 --repeats 2") \
        --out "$out/costmodel_compiled_${name}_${gpu}.json" ;;
    baselines-*)
      profile=$out/costmodel_compiled_${name}_${gpu}.json  # the part profile-compiled-MODEL's, run before
      serve="--policy patched-slo --cost-model $profile"
      if $quick; then  # the tiny model's sizes, a short load; gouache eager (a CPU compiles for minutes)
        load=(--sizes 256x256,384x384 --steps 2 --burst 4 --rate 2 --duration 3)
      else
        load=(--sizes 512x512,1024x1024 --steps 20 --burst 12 --rate 0.3 --duration 60)
        serve+=" --compile --compile-cuda-graphs --compile-sizes 512x512,1024x1024"
      fi
      if $print || [[ -f $profile ]]; then
        gouache bench baselines --model "$model" --device "$device" --dtype bfloat16 "${load[@]}" \
          --gouache-args "$serve" --out "$out/baselines_${name}_${gpu}.json"
      else
        echo "baselines-${part##*-} needs $profile: run profile-compiled-${part##*-} first" >&2; false
      fi ;;
    profile-*)
      gouache profile --model "$model" --device "$device" --dtype bfloat16 \
        $($quick && echo "--sizes 256,384 --max-batch 2 --samples 4 --repeats 1" \
          || echo "--sizes 512,768,1024 --max-batch 4 --samples 30 --repeats 2") \
        --out "$out/costmodel_${name}_${gpu}.json" ;;
    *) echo "unknown part $part" >&2; exit 2 ;;
  esac
  status=$?
  echo "== $part: exit $status after $((SECONDS - start)) s" >&2
  [[ $status == 0 ]] || failed="$failed $part"
done
[[ -z $failed ]] || { echo "failed or stopped:$failed" >&2; exit 1; }
