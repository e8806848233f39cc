#!/usr/bin/env bash
# Reproduce the GPU rows of docs/BENCHMARKS.md on one host:  bash scripts/bench_gpu.sh STAGE...
#   info      cards, driver, versions
#   smoke     the demo on all GPUs (bf16), 20 steps
#   ckpt7b    save a random Qwen2.5-7B-shaped HF checkpoint to $CKPT7B (bf16 safetensors)
#   fsdp      P-7B through the real loading path: ac.ratio 0 / 0.5 / 1, compile on and off
#   ckpt      7B checkpoint save / resume / HF export times
#   packing   V-7B: padded vs packed (flex attention)
#   attention causal attention fwd+bwd per SDPA backend at P-7B shapes
#   attnlong  the same at 32k and 64k tokens (batch 1), SDPA flash / cuDNN / efficient and compiled flex (~2 min)
#   attncp    one context-parallel rank's attention (cp 2) at 64k and 128k: time and peak memory
#   acp7b acp7bf8 acv7b ac32k   issue #24, meant for 2 GPUs (NGPU=2): whole-block vs op-level activation
#             checkpointing (ac.mode) and plan.auto's choice, one table each with tok/s/GPU, peak and reserved
#             GiB, allocator retries, and the planner's prediction per run: P-7B bf16 (~7 min; TRACE=1: ac 1
#             and 0.75 traced at steps 9-10), P-7B float8 (TRACE=1: plan.auto's run traced), V-7B packed
#             bf16 and float8, 32k tokens x 1 row bf16 and float8 (8 steps). ONLY=regex runs the matching runs
#   longctx   issue #25 on 2 GPUs (NGPU=2), Qwen2.5-7B shapes, fp32 masters, ac 1 (blocks or attention), one
#             row per cp group: a 64k document with cp 2, a 128k document with cp 2 + fsdp.cpu_offload (the
#             attention run profiled at step 5), 128k rows packed from the long tail (lengths log-normal, median
#             16k, clipped to [1k, 128k]); ~3-5 min per run. longctx4: 128k with cp 4 on 4 GPUs, single and packed
#   perf      P-7B (random init): defaults (with a profile of steps 9-10), ZeRO-2, bf16 reduce, NCCL CTAs,
#             grad-acc 4 with and without deferred gradient sync; ONLY=regex runs the matching variants
#   planner   peak memory vs the planner: Qwen2.5-0.5B on 1 GPU (seq 2048/4096) and 7B at seq 2048 (ac 0/0.5/1)
#   float8    precision.float8 none vs tensorwise vs rowwise: P-7B (tensorwise traces steps 9-10), V-7B packed,
#             Qwen2.5-72B widths with 16 of 80 blocks (mb 2, seq 4096; AC72=ratio, default 0 on >100 GB cards
#             else 1); ONLY=regex runs the matching runs. Needs torchao (a wheel in .whl/)
#   float8numerics  a 0.39B model learns byte-level Python source (scripts/text_tokens.py), 1200 steps,
#             one GPU per run (PER_GPU=2: two runs share each GPU): F8RUNS="recipe:seed ..." (default
#             bf16 / tensorwise / rowwise on seeds 0-1,
#             bf16 and tensorwise on seed 2); scripts/plot_float8.py compares each float8 run with the
#             bf16 run of its seed and writes docs/float8_numerics.png
#   s14b      Qwen2.5-14B shapes from an HF checkpoint on disk, ratio/micro-batch chosen by plan.auto
#   ckpt14b   14B checkpoint save / resume / HF export times
#   offload   fsdp.cpu_offload: P-7B, and Qwen2.5-14B shapes at the largest micro-batch the planner allows
#             (ONLY=regex picks offload-p7b / offload-14b);
#             measured GPU peak, host memory (per rank, node) and tok/s next to the planner's prediction
#   ckptasync P-7B with asynchronous saves every EVERY steps (default 5: each waits for the previous
#             write) twice and the synchronous final save 2 steps later: training time lost per save
#             (apart: waiting for the previous write or for the host buffers, copying to host), time
#             until committed, resume from the last checkpoint (SKIP_RESUME=1: not). EVERY=30: saves
#             as far apart as in a real run
#   twonode   slurm/train.slurm under fake srun/scontrol/getent: 2 "nodes" x 2 GPUs on this host, HSDP
#             (fsdp.replicate_degree=2), losses against the 4-GPU FSDP run
#   moe30b    issue #26, meant for 2 GPUs: Qwen3-30B-A3B widths with MOE_BLOCKS (default 10) of its 48 blocks
#             (fp32 master weights; 10 blocks are predicted at ~61 GiB per GPU on 2 GPUs), 2 rows x 4096 random
#             tokens per GPU, real routing; ac 0 and ac 1 with the planner's prediction each, then the peer
#             (scripts/trl_moe_bench.py: TRL + transformers 5, bf16 weights) on the same shapes, full AC and
#             none (PEER_AC="full none"), in the same call. ONLY=regex picks our runs. Needs the TRL wheels in .whl/
#   ep30b     issue #36, for 2 GPUs: the same stand-in at 4 rows x 4096 tokens per GPU without and with expert
#             parallelism (moe.ep_degree=NGPU; TRACE=1 profiles it at steps 9-10), and with it at 2 rows; then the
#             peer at 4 and 2 rows (PEER_BS), without AC (PEER_AC; its faster variant at both sizes in #26)
#   moonlight issue #46, for 2 GPUs: DeepSeek-V3 routing (sigmoid, correction bias, shared experts, MLA) at
#             Moonlight-16B-A3B's shapes, random init, P-7B rows: MOONLIGHT_BLOCKS (default 10) of its 27 blocks, fp32
#             state, 4 rows a GPU; then the whole model with plan.auto (lean state allowed)
#   leannumerics  issue #36: the float8numerics model and data, fp32 AdamW vs bf16 moments vs bf16 moments +
#             bf16 master weights (LEANRUNS="state:master ...", LEANSEED, LEANSTEPS), one GPU per run (PER_GPU=2); plot in
#             docs/lean_state_numerics.png
#   whole30b  issue #36, for 2 x H200: the whole Qwen3-30B-A3B (48 blocks, random init; MB rows a GPU and step,
#             default 2) and gpt-oss-20b on P-7B
#             rows with plan.auto (expert parallelism and lean state allowed: its choice), next to the planner's
#             prediction; whole30b-ep: the 30B with expert parallelism over every GPU and 8 bytes of state (issue
#             #62; plan.auto picks the rest); TRACE=1 profiles the 30B runs at steps 7-8; PEER_BS="4": then the peer on the whole 30B
#   config30b issue #36, for 2 x H200: configs/qwen3_30b_a3b.yaml's step (grad-acc 8, flex attention) under the layout
#             the planner names for 2 x 141 GiB, and under plan.auto's choice on this card
#   lora      issue #35: P-7B with rank-16 LoRA on every Linear of the blocks (bf16 base: ac 1 and
#             plan.auto; plan.auto with the base's matmuls in float8, tensorwise and rowwise) and QLoRA
#             (NF4 base: ac 1, plan.auto), then, with PEER_DIR set (a copy of the peer's
#             scripts, docs/BENCHMARKS.md), the peer's LoRA variants (PEER_VARIANTS, default "liger_lora
#             noac_liger_lora liger_qlora") on as many GPUs in the same call. ONLY=regex picks our runs;
#             TRACE=1: plan.auto's LoRA runs (bf16 and float8 tensorwise) traced at steps 9-10
#   lora30b   issue #46, one GPU: the whole Qwen3-30B-A3B with LoRA on the attention and every routed expert
#             (plan.auto; mb 2 ac 1), then the peer (TRL + peft target_parameters, the same adapters) at PEER_BS rows
#   lora35moe issue #58, one GPU: the whole Qwen3.5-35B-A3B (transformers' qwen3_5_moe_text defaults), random init,
#             LoRA rank 16 on q/k/v/o and every routed expert (plan.auto; mb 2 ac 1), then the peer on the same
#             adapters (scripts/trl_moe_bench.py --lora 16) at PEER_BS rows with PEER_AC (needs fla-core + tilelang)
#   acoffload issue #60, one GPU: ac.offload on and off, P-7B's model with LoRA on rows of OFFLOAD_LEN (32768) tokens, ac 1
#   longrow   issue #60, one GPU: Qwen3.5-9B LoRA at 256k and the whole Qwen3-30B-A3B LoRA at 128k with ac.offload
#   qlora30b  issue #46, one GPU: the same with QLoRA's NF4 base (experts too): plan.auto for an 80 GB card, mb 2 ac 1
#   qwen35    issue #45, for 2 GPUs: Qwen3.5 of 9B shapes (configs/models/qwen3.5-9b: transformers' qwen3_5_text
#             defaults, a Gated DeltaNet hybrid), random init, flash-linear-attention's kernels: each layer kind's kept
#             bytes per token (scripts/bench_block_memory.py at 9B and 27B widths; PROBE=0 skips), then P-7B rows
#             (ac 1, 0.5, and 0 at 1 row a micro-batch; plan.auto) and V-7B packed rows (ac 1; plan.auto), plan.auto
#             in bf16 and float8 tensorwise
#             (ONLY=regex picks)
#   qwen35peer  the peer on that model, same GPUs (PEER_DIR: a copy of the peer's scripts): TRL + Liger on P-7B
#             rows (PEER_VARIANTS, default "noac_liger liger") and on V-7B rows (PEER_VARLEN, default "pack2"); none
#             skips either. On a host of 4 GPUs both can run side by side: ours with CUDA_VISIBLE_DEVICES=0,1 NGPU=2,
#             the peer with CUDA_VISIBLE_DEVICES=2,3 NGPU=2 (run `info` first: it installs the wheels once)
#   qwen35big issue #45, for 2 x H200: the largest dense Qwen3.5 shapes (configs/models/qwen3.5-27b) on P-7B rows,
#             plan.auto with lean state allowed
#   Qwen3.5 needs fla-core, and on Hopper tilelang (Triton < 3.7.1 computes one of fla's backward kernels wrongly
#   there): tilelang and z3 are too large to carry as wheels, so they travel unpacked in .whl/*.tar.xz (below)
#   qlora72b  issue #35: Qwen2.5-72B shapes (random init) with QLoRA on one GPU (configs/qwen72b_qlora.yaml):
#             4096-token rows, 1 per step, STEPS steps, next to the planner's prediction
#   lora72b   issue #35: the same with a bf16 base (LoRA), for 2 x H200 (NGPU=2)
#   loragptoss  issue #59, one GPU: gpt-oss-20b with LoRA on q/k/v/o and every routed expert (plan.auto), and the peer
#   tiledmlp  issue #60, one GPU: P-7B LoRA on TILE_LEN-token rows (131072), ac 1, MLPs untiled and tiled (ac.mlp_tile_tokens)
#   startup   issue #58, one GPU: launch -> exit after step 2, twice with one fresh compile.cache_dir (cold: nothing
#             cached; warm: a relaunch, as after a requeue): P-7B rows with LoRA (ac 1) and the whole Qwen3-30B-A3B
#             with LoRA on its attention and experts (mb 2, ac 1), Qwen3.5-9B with LoRA (plan.auto; needs
#             fla-core + tilelang), random init; each run's wall time, start-up and
#             first step with what torch.compile took from the cache; and load30b-24: Qwen3-30B-A3B with 24 of
#             its 48 blocks saved as transformers saves it (30.5 GB), loaded by ours and by from_pretrained
#             (scripts/bench_load.py), then the same LoRA run from it; lora-p7b-files: P-7B LoRA from the
#             peer's checkpoint of the 7B (15 GB), and with PEER_DIR set TRL's launch -> step 2 on the same files
#             (ONLY=regex picks lora-p7b / lora30b / lora-qwen35-9b / load30b-24 / lora-p7b-files)
#   images    issue #61, one GPU: Qwen3.5-9B shapes as published (configs/models/qwen3.5-9b-vl, random weights saved
#             once to /tmp) on rows of one 448 x 448 picture and ~1.1k text tokens (scripts/image_bench_data.py),
#             LoRA r16, the tower frozen: configs/bench/images.yaml as it is and with plan.auto (needs fla-core + tilelang),
#             then the peer on the same files and rows (scripts/trl_vlm_bench.py; VLM_PEER picks its variants);
#             with IMAGE_VARLEN=1 the replies vary in length (log-normal, sigma 0.8) and ours packs them
#             (data.packing, 8,192-token rows, plan.auto) against the peer's padded batches
#   summary   one table of all runs
# Results: runs/bench/<name>/metrics.jsonl and logs; with $OUT set, a tarball + summary there.
# EXTRA="key=value ..." appends overrides to every run of an ac_runs stage (e.g. logging.profile_steps=[6,7]).
set -u
cd "$(dirname "$0")/.."
if [ -d .whl ]; then  # the GPU image lacks `datasets`: wheels carried in .whl/, installed once per set of wheels
  # (two invocations may run side by side on disjoint GPUs: run one stage first, e.g. `info`)
  wheels=$(ls .whl)
  # .whl/*.tar.xz: site folders (packages unpacked as pip installs them), for packages whose wheels are too large
  # for a carry: made with `tar -cJf .whl/NAME.tar.xz -C DIR .` of a folder the wheels were unzipped into
  [ "$(cat /tmp/site/.installed 2>/dev/null)" = "$wheels" ] || { { ! ls .whl/*.whl >/dev/null 2>&1 || python3 -m pip \
    install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl; } && for t in .whl/*.tar.xz; do
    [ ! -f "$t" ] || tar -xJf "$t" -C /tmp/site || exit 1; done && echo "$wheels" > /tmp/site/.installed; }
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
NGPU=${NGPU:-$(nvidia-smi -L | wc -l)}
CKPT7B=${CKPT7B:-/tmp/qwen2.5-7b-random}
STEPS=${STEPS:-12}
LOGS=runs/bench/logs
# Qwen2.5-72B's shapes, random weights, the P-7B rows: the 72B LoRA stages' overrides of configs/qwen72b_qlora.yaml
LORA72B="model.name_or_path=configs/models/qwen2.5-72b model.init=random model.tokenizer=configs/demo/model \
data.path=data/bench/p7b.parquet data.eval_fraction=0 data.pad_to=max_seq_len train.output_dir=runs/bench \
train.grad_accum_steps=1 train.overwrite=true checkpoint.enabled=false checkpoint.export_hf=false \
eval.every_steps=0 logging.every_steps=1"
mkdir -p "$LOGS"

train() {  # train NAME CONFIG OVERRIDES...  (later overrides win, so OVERRIDES may rename the run)
  local name=$1 config=$2; shift 2
  local t0=$SECONDS
  timeout "${RUN_TIMEOUT:-300}" torchrun --standalone --nproc_per_node "$NGPU" train.py --config "$config" \
    train.run_name="$name" "$@" >"$LOGS/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc in $((SECONDS - t0)) s"; cp -f runs/bench/"$name"/metrics.jsonl "$LOGS/$name.metrics.jsonl" 2>/dev/null
  if [ $rc -ne 0 ]; then grep -v "^\s*$" "$LOGS/$name.log" | grep -iE "error|exception|memory" | head -3; tail -3 "$LOGS/$name.log"
  else grep -E "start-up|^\[.*step (1|$STEPS)/" "$LOGS/$name.log" | tail -3; fi
}

p7b_data() {  # p7b_data [ROWS_PER_STEP_PER_GPU]: the P-7B token file, enough samples for every stage's runs (default 8)
  python3 scripts/synthetic_tokens.py --out data/bench/p7b.parquet --samples $((NGPU * ${1:-8} * STEPS)) --length 4096
}

ac_runs() {  # ac_runs STAGE <<< "NAME CONFIG OVERRIDES" lines: each run with the planner's view of it, one table
  local stage=$1 t_stage=$SECONDS runs=()
  local gpu_gib; gpu_gib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 | awk '{print $1 / 1024}')
  while read -r name config overrides; do
    [[ "$name" =~ ${ONLY:-.} ]] || continue
    # shellcheck disable=SC2086
    train "$name" "$config" train.max_steps="$STEPS" $overrides ${EXTRA:-} </dev/null
    runs+=("runs/bench/$name/")
    if [[ "$overrides" == *plan.auto=true* ]]; then
      grep -h "plan.auto:" "$LOGS/$name.log" | head -1
    else  # shellcheck disable=SC2086
      python3 -m sft.plan --config "$config" --gpus "$NGPU" --gpu-mem "$gpu_gib" $overrides 2>/dev/null | grep "^this config"
    fi
    [[ "$overrides" =~ precision.float8=(tensorwise|rowwise) ]] && float8_applied "$name"
    [ -f "runs/bench/$name/profile/summary.txt" ] && cp "runs/bench/$name/profile/summary.txt" "$LOGS/$name.profile.txt"
  done
  [ ${#runs[@]} -gt 0 ] && python3 scripts/bench_summary.py "${runs[@]}" --warmup "${WARMUP:-4}" | tee "runs/bench/$stage.md"
  echo "stage $stage took $((SECONDS - t_stage)) s"
}

moe_standin() {  # the Qwen3-30B-A3B stand-in: its widths with MOE_BLOCKS (default 10) of its 48 blocks; prints its dir
  local blocks=${MOE_BLOCKS:-10} moe=/tmp/qwen3-30b-a3b-${MOE_BLOCKS:-10}blocks
  mkdir -p "$moe"
  python3 -c "import json, sys; c = json.load(open('configs/models/qwen3-30b-a3b/config.json'))
c.update(num_hidden_layers=int(sys.argv[2]), max_window_layers=int(sys.argv[2])); json.dump(c, open(sys.argv[1] + '/config.json', 'w'), indent=2)" \
    "$moe" "$blocks"
  echo "$moe"
}

moonlight_standin() {  # Moonlight-16B-A3B (DeepSeek-V3 routing) with MOONLIGHT_BLOCKS (default 10) of its 27 blocks; prints its dir
  local moe=/tmp/moonlight-16b-a3b-${MOONLIGHT_BLOCKS:-10}blocks
  mkdir -p "$moe"
  python3 -c "import json, sys; c = json.load(open('configs/models/moonlight-16b-a3b/config.json'))
c.update(num_hidden_layers=int(sys.argv[2])); json.dump(c, open(sys.argv[1] + '/config.json', 'w'), indent=2)" \
    "$moe" "${MOONLIGHT_BLOCKS:-10}"
  echo "$moe"
}

moe_loads() {  # moe_loads RUN_DIR...: the last step's MoE metrics (real routing is unbalanced)
  for run in "$@"; do
    tail -1 "$run/metrics.jsonl" | python3 -c "import json, sys; e = json.loads(sys.stdin.read())
print(sys.argv[1], 'aux', round(e['aux_loss'], 4), 'load max/mean per layer', [round(x, 2) for x in e['expert_load_max_over_mean']])" "$run"
  done
}

peer_moe() {  # peer_moe MODEL_DIR ROWS_PER_GPU AC...: scripts/trl_moe_bench.py (TRL + transformers 5) on the same shapes
  # from a random checkpoint it writes to /tmp (PEER_RANDOM=1, one GPU only: the model built from MODEL_DIR's
  # config on the GPU, no checkpoint; on several, accelerate's FSDP2 preparation needs twice the model there)
  local moe=$1 bs=$2 model hf; shift 2
  hf=/tmp/$(basename "$moe")-hf
  if [ -n "${PEER_RANDOM:-}" ]; then model=("$moe" --random)
  else [ -d "$hf" ] || python3 scripts/trl_moe_bench.py make-model "$moe" "$hf"; model=("$hf"); fi
  for ac in "$@"; do
    local log="$LOGS/trl-moe30b-bs$bs-ac-$ac.log"
    timeout "${RUN_TIMEOUT:-300}" torchrun --standalone --nproc_per_node "$NGPU" scripts/trl_moe_bench.py train \
      --model "${model[@]}" --ac "$ac" --bs "$bs" --steps "$STEPS" >"$log" 2>&1
    echo "trl-moe30b-bs$bs-ac-$ac: exit $?"
    if grep -q RESULT "$log"; then grep RESULT "$log" | tee -a runs/bench/moe30b.md
    else grep -iE "error|out of memory" "$log" | tail -3; fi
  done
}

float8_applied() {  # float8_applied NAME: warn if a float8 run trained without converting anything
  grep -q "applied float8" "$LOGS/$1.log" || echo "WARNING: $1 ran without float8 (no 'applied float8' in its log)"
}

hf_checkpoint() {  # hf_checkpoint SHAPES DIR: a random bf16 Hugging Face checkpoint of those shapes, timed
  local t0=$SECONDS
  python3 scripts/save_random_checkpoint.py "$1" "$2" --device cuda
  echo "saved $2 in $((SECONDS - t0)) s"; du -sh "$2"
}

node_used_gib() {  # host memory in use on this node (MemTotal - MemAvailable; counts pinned memory too)
  awk '/^MemTotal:/{t=$2} /^MemAvailable:/{a=$2} END{printf "%.1f\n", (t-a)/1048576}' /proc/meminfo
}

offload_run() {  # offload_run NAME OVERRIDES...: P-7B config + fsdp.cpu_offload, measured next to `python -m sft.plan`
  local name=$1; shift
  local before; before=$(node_used_gib)
  ( while :; do node_used_gib; sleep 0.5; done ) >"$LOGS/$name.host_used" &
  local sampler=$!
  (  # torchrun sets OMP_NUM_THREADS=1 per rank: the AdamW step on the host would use one core
    export OMP_NUM_THREADS=$(($(nproc) / NGPU))
    train "$name" configs/bench/p7b.yaml fsdp.cpu_offload=true "$@"
  )
  kill $sampler
  python3 scripts/bench_summary.py "runs/bench/$name/" --warmup 4
  python3 -c "import sys; from pathlib import Path; from sft.training.metrics import read_metrics
print('host peak RSS per rank after loading (GiB):', read_metrics(Path(sys.argv[1]))[0][1]['host_peak_rss_gib_per_rank'])" \
    "runs/bench/$name"
  echo "node host memory in use: $before GiB before, $(sort -n "$LOGS/$name.host_used" | tail -1) GiB peak during the run"
  python3 -m sft.plan --config configs/bench/p7b.yaml --gpus "$NGPU" --gpu-mem "$GPU_GIB" --host-mem "$HOST_GIB" \
    --gpus-per-node "$NGPU" fsdp.cpu_offload=true "$@" | grep -E "^this config|^host"
}

for stage in "$@"; do
  case $stage in
    info)
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
      python3 -c "import torch, transformers, pyarrow, datasets; print(torch.__version__, transformers.__version__, pyarrow.__version__, datasets.__version__)" ;;
    smoke)
      python3 scripts/demo_data.py --out data/demo >/dev/null
      train smoke configs/demo.yaml train.max_steps=20 fsdp.param_dtype=bfloat16 ;;
    ckpt7b)
      hf_checkpoint configs/models/qwen2.5-7b "$CKPT7B" ;;
    fsdp)
      p7b_data
      for compile in true false; do for ratio in 1 0.5 0; do
        train "p7b-compile-$compile-ac$ratio" configs/bench/p7b.yaml model.name_or_path="$CKPT7B" \
          model.init=pretrained compile.enabled=$compile ac.ratio=$ratio train.max_steps="$STEPS"
      done; done ;;
    ckpt)  # save + resume + export times for the 7B model (needs ckpt7b)
      p7b_data
      P7B=(configs/bench/p7b.yaml model.name_or_path="$CKPT7B" model.init=pretrained train.overwrite=false)
      train p7b-ckpt "${P7B[@]}" train.max_steps=8 checkpoint.export_hf=true
      grep -E "saved|exported" "$LOGS/p7b-ckpt.log"
      rm -f runs/bench/p7b-ckpt/finished  # continue the same run: resume + 2 more steps
      train p7b-ckpt-resumed "${P7B[@]}" train.run_name=p7b-ckpt train.max_steps=10
      grep -E "resumed|saved" "$LOGS/p7b-ckpt-resumed.log"
      du -sh runs/bench/p7b-ckpt/checkpoints/* runs/bench/p7b-ckpt/export; rm -rf runs/bench/p7b-ckpt/checkpoints ;;
    packing)  # workload V-7B: padded to the longest vs packed rows with flex attention
      python3 scripts/synthetic_tokens.py --out data/bench/v7b.parquet --samples 4000 --lognormal 600 0.8
      train v7b-padded configs/bench/v7b.yaml train.max_steps="$STEPS"
      train v7b-packed configs/bench/v7b.yaml train.max_steps="$STEPS" data.packing=true train.micro_batch_size=2 \
        model.attn_implementation=flex_attention ;;
    attention)
      python3 scripts/bench_attention.py --batch 2 --seq 4096 --heads 28 --kv-heads 4 --head-dim 128 ;;
    attnlong)  # long context (issue #24): which attention kernel is fastest at 32k and 64k tokens per row
      python3 scripts/bench_attention.py --batch 1 --seq 32768 65536 --heads 28 --kv-heads 4 --head-dim 128 --iters 10 |
        tee runs/bench/attnlong.md ;;
    attncp)  # issue #25: one cp rank's attention (cp 2) at 64k and 128k tokens per row: time and memory
      python3 scripts/bench_attention.py --batch 1 --seq 65536 131072 --cp 2 --heads 28 --kv-heads 4 --head-dim 128 \
        --iters 5 | tee runs/bench/attncp.md ;;
    acp7b)  # P-7B bf16: ac 1 to 0.5 (TRACE=1: ac 1 and 0.75 traced at steps 9-10); op-level checkpointing at ac 1 and 0.75
      p7b_data
      TRACED=${TRACE:+logging.profile_steps=[9,10]}
      ac_runs acp7b <<RUNS
acp7b-ac1              configs/bench/p7b.yaml ac.ratio=1 $TRACED
acp7b-ac0.75           configs/bench/p7b.yaml ac.ratio=0.75 $TRACED
acp7b-ac0.5            configs/bench/p7b.yaml ac.ratio=0.5
acp7b-ac1-ops_half     configs/bench/p7b.yaml ac.ratio=1 ac.mode=ops_half
acp7b-ac1-attention    configs/bench/p7b.yaml ac.ratio=1 ac.mode=attention
acp7b-ac1-ops          configs/bench/p7b.yaml ac.ratio=1 ac.mode=ops
acp7b-ac0.75-ops_half  configs/bench/p7b.yaml ac.ratio=0.75 ac.mode=ops_half
acp7b-auto             configs/bench/p7b.yaml plan.auto=true
acp7b-ac1-bf16reduce   configs/bench/p7b.yaml ac.ratio=1 fsdp.reduce_dtype=bfloat16
acp7b-ac1-ops_half-bf16reduce configs/bench/p7b.yaml ac.ratio=1 ac.mode=ops_half fsdp.reduce_dtype=bfloat16
RUNS
      ;;
    acp7bf8)  # P-7B float8 tensorwise: ac 1 to 0.5, op-level at ac 1 and 0.75, plan.auto (TRACE=1: traced at steps 9-10)
      p7b_data
      TRACED=${TRACE:+logging.profile_steps=[9,10]}
      ac_runs acp7bf8 <<RUNS
acp7bf8-ac1            configs/bench/p7b.yaml precision.float8=tensorwise ac.ratio=1
acp7bf8-ac0.75         configs/bench/p7b.yaml precision.float8=tensorwise ac.ratio=0.75
acp7bf8-ac0.5          configs/bench/p7b.yaml precision.float8=tensorwise ac.ratio=0.5
acp7bf8-ac1-ops_half   configs/bench/p7b.yaml precision.float8=tensorwise ac.ratio=1 ac.mode=ops_half
acp7bf8-ac0.75-ops_half configs/bench/p7b.yaml precision.float8=tensorwise ac.ratio=0.75 ac.mode=ops_half
acp7bf8-ac1-ops        configs/bench/p7b.yaml precision.float8=tensorwise ac.ratio=1 ac.mode=ops
acp7bf8-auto           configs/bench/p7b.yaml precision.float8=tensorwise plan.auto=true $TRACED
RUNS
      ;;
    acv7b)  # V-7B packed (flex attention), bf16 and float8
      python3 scripts/synthetic_tokens.py --out data/bench/v7b.parquet --samples 4000 --lognormal 600 0.8
      PACKED="data.packing=true train.micro_batch_size=2 model.attn_implementation=flex_attention"
      ac_runs acv7b <<RUNS
acv7b-ac1              configs/bench/v7b.yaml $PACKED ac.ratio=1
acv7b-ac0.75           configs/bench/v7b.yaml $PACKED ac.ratio=0.75
acv7b-ac1-ops_half     configs/bench/v7b.yaml $PACKED ac.ratio=1 ac.mode=ops_half
acv7b-auto             configs/bench/v7b.yaml $PACKED plan.auto=true
acv7bf8-ac1            configs/bench/v7b.yaml $PACKED precision.float8=tensorwise ac.ratio=1
acv7bf8-auto           configs/bench/v7b.yaml $PACKED precision.float8=tensorwise plan.auto=true
RUNS
      ;;
    ac32k)  # 32k tokens, 1 row per GPU (8 steps of ~5 s): ac 1 blocks or attention (traced at step 6, with the allocator by stream); plan.auto
      python3 scripts/synthetic_tokens.py --out data/bench/len32k.parquet --samples $((NGPU * 8)) --length 32768
      LONG="data.path=data/bench/len32k.parquet data.max_seq_len=32768 train.micro_batch_size=1"
      STEPS=8 ac_runs ac32k <<RUNS
ac32k-ac1              configs/bench/p7b.yaml $LONG ac.ratio=1
ac32k-ac1-attention    configs/bench/p7b.yaml $LONG ac.ratio=1 ac.mode=attention logging.profile_steps=[6,6]
ac32k-auto             configs/bench/p7b.yaml $LONG plan.auto=true
ac32kf8-ac1            configs/bench/p7b.yaml $LONG precision.float8=tensorwise ac.ratio=1
ac32kf8-ac1-attention  configs/bench/p7b.yaml $LONG precision.float8=tensorwise ac.ratio=1 ac.mode=attention
ac32kf8-auto           configs/bench/p7b.yaml $LONG precision.float8=tensorwise plan.auto=true
RUNS
      ;;
    longctx|longctx4)  # issue #25: context parallelism at 64k / 128k tokens per row
      python3 scripts/synthetic_tokens.py --out data/bench/len64k.parquet --samples 8 --length 65536
      python3 scripts/synthetic_tokens.py --out data/bench/len128k.parquet --samples 8 --length 131072
      python3 scripts/synthetic_tokens.py --out data/bench/tail128k.parquet --samples 100 --length 131072 \
        --min-length 1024 --lognormal 16384 1.0
      export OMP_NUM_THREADS=$(($(nproc) / NGPU))  # the host AdamW step of the offloaded runs
      ROW64="configs/bench/p7b.yaml train.micro_batch_size=1 ac.ratio=1 data.max_seq_len=65536 data.path=data/bench/len64k.parquet"
      ROW128="configs/bench/p7b.yaml train.micro_batch_size=1 ac.ratio=1 data.max_seq_len=131072"
      if [ "$stage" = longctx ]; then
        STEPS=${STEPS_LONG:-6} WARMUP=2 RUN_TIMEOUT=480 ac_runs longctx <<RUNS
lc64k-cp2                $ROW64 cp.degree=2
lc64k-cp2-attention      $ROW64 cp.degree=2 ac.mode=attention
lc128k-cp2-offload-attention $ROW128 cp.degree=2 data.path=data/bench/len128k.parquet fsdp.cpu_offload=true ac.mode=attention logging.profile_steps=[5,5]
lc128k-cp2-offload       $ROW128 cp.degree=2 data.path=data/bench/len128k.parquet fsdp.cpu_offload=true
lc128k-packed-cp2-offload $ROW128 cp.degree=2 data.path=data/bench/tail128k.parquet data.packing=true fsdp.cpu_offload=true
lc64k-cp2-f8             $ROW64 cp.degree=2 precision.float8=tensorwise
RUNS
      else
        STEPS=${STEPS_LONG:-6} WARMUP=2 RUN_TIMEOUT=480 ac_runs longctx4 <<RUNS
lc128k-cp4-attention     $ROW128 cp.degree=4 data.path=data/bench/len128k.parquet ac.mode=attention logging.profile_steps=[5,5]
lc128k-cp4               $ROW128 cp.degree=4 data.path=data/bench/len128k.parquet
lc128k-packed-cp4-attention $ROW128 cp.degree=4 data.path=data/bench/tail128k.parquet data.packing=true ac.mode=attention
RUNS
      fi ;;
    perf)  # P-7B, one change at a time against the defaults; the first run also traces steps 9-10
      p7b_data
      P7B=(configs/bench/p7b.yaml train.max_steps="$STEPS")
      while read -r name overrides; do
        [[ "$name" =~ ${ONLY:-.} ]] || continue
        (  # a subshell: an environment setting (NCCL_*=...) before the keys applies to this run only
          case $overrides in NCCL_*) export "${overrides%% *}"; overrides=${overrides#* };; esac
          # shellcheck disable=SC2086
          train "p7b-$name" "${P7B[@]}" $overrides </dev/null
        )
      done <<'RUNS'
default     logging.profile_steps=[9,10]
zero2       fsdp.reshard_after_forward=false
bf16reduce  fsdp.reduce_dtype=bfloat16
zero2-bf16  fsdp.reshard_after_forward=false fsdp.reduce_dtype=bfloat16
ctas8       NCCL_MAX_CTAS=8 train.max_steps=12
ga4-sync    train.grad_accum_steps=4 train.max_steps=8
ga4-nosync  train.grad_accum_steps=4 train.max_steps=8 fsdp.sync_grads_each_microbatch=false
RUNS
      [ -f runs/bench/p7b-default/profile/summary.txt ] && cp runs/bench/p7b-default/profile/summary.txt "$LOGS/p7b-default.profile.txt" ;;
    planner)  # peaks to compare with `python -m sft.plan` (docs/BENCHMARKS.md "Memory planner")
      for len in 2048 4096; do
        python3 scripts/synthetic_tokens.py --out data/bench/len$len.parquet --samples $((NGPU * 2 * STEPS)) --length $len
      done
      gpu=0; pids=()
      for len in 2048 4096; do for ratio in 0 0.5 1; do  # 0.5B: one GPU each, up to NGPU at a time
        CUDA_VISIBLE_DEVICES=$gpu NGPU=1 train "q05b-s$len-ac$ratio" configs/bench/p7b.yaml model.name_or_path=configs/models/qwen2.5-0.5b \
          data.path=data/bench/len$len.parquet data.max_seq_len=$len ac.ratio=$ratio train.max_steps=8 &
        pids+=($!); gpu=$(((gpu + 1) % NGPU)); [ $gpu -eq 0 ] && wait "${pids[@]}" && pids=()
      done; done; wait
      for ratio in 0 0.5 1; do
        train "p7b-s2048-ac$ratio" configs/bench/p7b.yaml data.path=data/bench/len2048.parquet data.max_seq_len=2048 \
          ac.ratio=$ratio train.max_steps=8
      done ;;
    float8)  # every run is the bf16 one with only precision.float8 changed
      t_stage=$SECONDS
      p7b_data
      python3 scripts/synthetic_tokens.py --out data/bench/v7b.parquet --samples 4000 --lognormal 600 0.8
      ac72=${AC72:-$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1 |
                     awk '{print ($1 > 100000) ? 0 : 1}')}  # mb 2, ac 0 peaks at ~97 GiB (4 x H200)
      while read -r name config overrides; do
        [[ "$name" =~ ${ONLY:-.} ]] || continue
        # shellcheck disable=SC2086
        train "$name" "$config" train.max_steps="$STEPS" $overrides ${EXTRA:-} </dev/null
        [[ "$overrides" == *float8=none* ]] || float8_applied "$name"
      done <<RUNS
p7b-bf16             configs/bench/p7b.yaml precision.float8=none
p7b-f8-tensorwise    configs/bench/p7b.yaml precision.float8=tensorwise logging.profile_steps=[9,10]
p7b-f8-rowwise       configs/bench/p7b.yaml precision.float8=rowwise
p7b-f8-tensorwise-bf16reduce configs/bench/p7b.yaml precision.float8=tensorwise fsdp.reduce_dtype=bfloat16
v7b-packed-bf16      configs/bench/v7b.yaml precision.float8=none data.packing=true train.micro_batch_size=2 model.attn_implementation=flex_attention
v7b-packed-f8-tensorwise configs/bench/v7b.yaml precision.float8=tensorwise data.packing=true train.micro_batch_size=2 model.attn_implementation=flex_attention
q72b16-bf16          configs/bench/p7b.yaml precision.float8=none model.name_or_path=configs/models/qwen2.5-72b-16blocks ac.ratio=$ac72
q72b16-f8-tensorwise configs/bench/p7b.yaml precision.float8=tensorwise model.name_or_path=configs/models/qwen2.5-72b-16blocks ac.ratio=$ac72
RUNS
      [ -f runs/bench/p7b-f8-tensorwise/profile/summary.txt ] &&
        cp runs/bench/p7b-f8-tensorwise/profile/summary.txt "$LOGS/p7b-f8-tensorwise.profile.txt"
      python3 scripts/bench_summary.py runs/bench/{p7b-bf16,p7b-f8-*,v7b-packed-bf16,v7b-packed-f8-*,q72b16-*}/ --warmup 4 |
        tee runs/bench/float8.md
      echo "stage float8 took $((SECONDS - t_stage)) s" ;;
    float8numerics)  # one-GPU runs, PER_GPU on each GPU at once (in waves); a failed run leaves the others
      t_stage=$SECONDS
      python3 scripts/text_tokens.py --out data/float8num
      slot=0; pids=()
      for run in ${F8RUNS:-none:0 tensorwise:0 rowwise:0 none:1 tensorwise:1 rowwise:1 none:2 tensorwise:2}; do
        recipe=${run%:*} seed=${run#*:}
        (
          CUDA_VISIBLE_DEVICES=$((slot % NGPU)) NGPU=1 RUN_TIMEOUT=${RUN_TIMEOUT:-400} train "f8num-$recipe-s$seed" \
            configs/bench/float8_numerics.yaml precision.float8="$recipe" train.seed="$seed"
          [ "$recipe" = none ] || float8_applied "f8num-$recipe-s$seed"
        ) &
        pids+=($!); slot=$(((slot + 1) % (NGPU * ${PER_GPU:-1}))); [ $slot -eq 0 ] && wait "${pids[@]}" && pids=()
      done; wait
      python3 scripts/plot_float8.py runs/bench/f8num-*/ --out docs/float8_numerics.png | tee runs/bench/float8_numerics.md
      cp docs/float8_numerics.png runs/bench/ 2>/dev/null
      echo "stage float8numerics took $((SECONDS - t_stage)) s" ;;
    leannumerics)  # issue #36: the float8 numerics' model and data with lean optimizer state, as float8numerics runs
      t_stage=$SECONDS
      python3 scripts/text_tokens.py --out data/float8num
      slot=0; pids=()
      for run in ${LEANRUNS:-float32:float32 bfloat16:float32 bfloat16:bfloat16}; do
        state=${run%:*} master=${run#*:}
        (
          CUDA_VISIBLE_DEVICES=$((slot % NGPU)) NGPU=1 RUN_TIMEOUT=${RUN_TIMEOUT:-400} train "leannum-$state-$master-s${LEANSEED:-0}" \
            configs/bench/float8_numerics.yaml optim.state_dtype="$state" optim.master_dtype="$master" \
            train.max_steps="${LEANSTEPS:-1200}" train.seed="${LEANSEED:-0}"
        ) &
        pids+=($!); slot=$(((slot + 1) % (NGPU * ${PER_GPU:-1}))); [ $slot -eq 0 ] && wait "${pids[@]}" && pids=()
      done; wait
      python3 scripts/plot_float8.py runs/bench/leannum-*/ --out docs/lean_state_numerics.png --tolerance 0.01 \
        | tee runs/bench/lean_numerics.md
      cp docs/lean_state_numerics.png runs/bench/ 2>/dev/null
      echo "stage leannumerics took $((SECONDS - t_stage)) s" ;;
    whole30b)  # issue #36, for 2 x H200: the whole Qwen3-30B-A3B (random init), expert parallel, lean state, plan.auto
      p7b_data
      ac_runs whole30b <<RUNS
whole30b configs/bench/p7b.yaml model.name_or_path=configs/models/qwen3-30b-a3b plan.auto=true plan.allow_lean_state=true train.micro_batch_size=${MB:-2} ${TRACE:+logging.profile_steps=[7,8]}
whole-gptoss20b configs/bench/p7b.yaml model.name_or_path=configs/models/gpt-oss-20b model.attn_implementation=flex_attention plan.auto=true plan.allow_lean_state=true
whole30b-ep configs/bench/p7b.yaml model.name_or_path=configs/models/qwen3-30b-a3b plan.auto=true train.micro_batch_size=${MB:-2} moe.ep_degree=$NGPU optim.state_dtype=bfloat16 optim.master_dtype=bfloat16 fsdp.reduce_dtype=bfloat16 ${TRACE:+logging.profile_steps=[7,8]}
RUNS
      moe_loads runs/bench/whole30b runs/bench/whole-gptoss20b
      # the peer on the whole 30B (4 GPUs: it does not fit 2) at PEER_BS rows, full AC, from a checkpoint it writes
      # (61 GB; accelerate's FSDP2 preparation of a model built on each GPU needs twice its bytes there)
      for bs in ${PEER_BS:-}; do peer_moe configs/models/qwen3-30b-a3b "$bs" full; done ;;
    config30b)  # issue #36, for 2 x H200: configs/qwen3_30b_a3b.yaml's shape of step (grad-acc 8, flex attention) on
      # P-7B rows, random init: the layout `python -m sft.plan --config configs/qwen3_30b_a3b.yaml --gpus 2
      # --gpu-mem 141` names, then plan.auto's choice on this card (STEPS=5 WARMUP=2: a step is 16 rows a GPU)
      p7b_data 16
      C30B="configs/bench/p7b.yaml model.name_or_path=configs/models/qwen3-30b-a3b model.attn_implementation=flex_attention train.grad_accum_steps=8"
      ac_runs config30b <<RUNS
config30b-named $C30B moe.ep_degree=2 optim.state_dtype=bfloat16 optim.master_dtype=bfloat16 fsdp.reduce_dtype=bfloat16 ac.ratio=1 ac.mode=attention
config30b-auto $C30B plan.auto=true plan.allow_lean_state=true
RUNS
      ;;
    s14b)  # the 4-GPU stand-in for the 8-GPU 32B run: real loading path, plan.auto
      p7b_data
      hf_checkpoint configs/models/qwen2.5-14b /tmp/qwen2.5-14b-random
      train s14b configs/bench/p7b.yaml model.name_or_path=/tmp/qwen2.5-14b-random model.init=pretrained \
        plan.auto=true train.grad_accum_steps=2 train.max_steps=8
      grep -E "plan.auto|RSS|start-up" "$LOGS/s14b.log" ;;
    ckpt14b)  # 14B: checkpoint save / resume / HF export times (~210 GB of disk at the peak)
      p7b_data
      [ -d /tmp/qwen2.5-14b-random ] || hf_checkpoint configs/models/qwen2.5-14b /tmp/qwen2.5-14b-random
      S14B=(configs/bench/p7b.yaml model.name_or_path=/tmp/qwen2.5-14b-random model.init=pretrained plan.auto=true
            train.grad_accum_steps=2 train.overwrite=false)
      train s14b-ckpt "${S14B[@]}" train.max_steps=3 checkpoint.enabled=true
      grep -E "saved" "$LOGS/s14b-ckpt.log"; du -sh runs/bench/s14b-ckpt/checkpoints/step-*
      rm -f runs/bench/s14b-ckpt/finished  # continue the same run: resume + 1 step, no second save
      train s14b-ckpt-resumed "${S14B[@]}" train.run_name=s14b-ckpt train.max_steps=4 checkpoint.enabled=false
      grep -E "resumed" "$LOGS/s14b-ckpt-resumed.log"
      rm -rf /tmp/qwen2.5-14b-random  # room for the export
      t0=$SECONDS; python3 -m sft.export runs/bench/s14b-ckpt/checkpoints/step-3 runs/bench/s14b-export
      echo "exported in $((SECONDS - t0)) s"; du -sh runs/bench/s14b-export; rm -rf runs/bench/s14b-ckpt/checkpoints runs/bench/s14b-export ;;
    offload)  # P-7B (~8 steps) and Qwen2.5-14B shapes (random init) with fsdp.cpu_offload=true, ~4 min
      p7b_data
      GPU_GIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 | awk '{print $1 / 1024}')
      HOST_GIB=$(awk '/^MemTotal:/{print $2 / 1048576}' /proc/meminfo)
      [[ offload-p7b =~ ${ONLY:-.} ]] && RUN_TIMEOUT=${RUN_TIMEOUT:-120} offload_run offload-p7b train.max_steps=8
      if [[ offload-14b =~ ${ONLY:-.} ]]; then
        # The largest micro-batch the planner lets fit this GPU (grad-acc 1), with the least recomputation.
        read -r MB RATIO < <(python3 -c "
from sft.config import load_config
from sft.models.build import build_meta_model
from sft.plan import MICRO_BATCHES, RATIOS, Machine, Shapes, predict_gib
cfg = load_config('configs/bench/p7b.yaml', ['model.name_or_path=configs/models/qwen2.5-14b', 'fsdp.cpu_offload=true'])
s, m = Shapes.of(build_meta_model(cfg.model)), Machine.of($NGPU, $GPU_GIB, $HOST_GIB)
mb, r = max((mb, -r) for mb in MICRO_BATCHES for r in RATIOS if m.fits(predict_gib(s, cfg, $NGPU, mb, r, "blocks")))
print(mb, -r)")
        echo "offload-14b: micro-batch $MB, ac.ratio $RATIO (planner, $GPU_GIB GiB GPUs)"
        RUN_TIMEOUT=${RUN_TIMEOUT:-180} offload_run offload-14b model.name_or_path=configs/models/qwen2.5-14b \
          train.micro_batch_size="$MB" ac.ratio="$RATIO" train.max_steps=6
      fi ;;
    ckptasync)  # saves every EVERY (5) steps: each waits for the previous write (50-90 s for 7B), which the log separates
      STEPS=$((2 * ${EVERY:-5} + 3)) p7b_data  # enough samples for the run and its resume
      CK=(configs/bench/p7b.yaml checkpoint.enabled=true checkpoint.every_steps=${EVERY:-5} checkpoint.keep_last=1
          train.overwrite=false)
      RUN_TIMEOUT=${RUN_TIMEOUT:-420} train p7b-ckpt-async "${CK[@]}" train.max_steps=$((2 * ${EVERY:-5} + 2))
      grep -E "saved|committed|copied|waited" "$LOGS/p7b-ckpt-async.log"
      python3 - "$LOGS/p7b-ckpt-async.log" runs/bench/p7b-ckpt-async <<'PY'
import re, statistics, sys
from pathlib import Path
from sft.training.metrics import read_metrics
log, run = Path(sys.argv[1]).read_text(), Path(sys.argv[2])
steps, _ = read_metrics(run)
waited = buffers = copied = 0.0
saves = {}  # step -> (blocked, of which waiting for the previous write, for the host buffers, copying to host)
for line in log.splitlines():
    if m := re.search(r"waited ([\d.]+) s for the previous save", line):
        waited = float(m[1])
    elif m := re.search(r"waited ([\d.]+) s for the host buffers", line):
        buffers = float(m[1])
    elif m := re.search(r"copied the state to host memory in ([\d.]+) s", line):
        copied = float(m[1])
    elif m := re.search(r"saved \S*step-(\d+) in ([\d.]+) s \(training blocked", line):
        saves[int(m[1])] = (float(m[2]), waited, buffers, copied)
        waited = buffers = copied = 0.0
normal = statistics.median(steps[s]["step_time"] for s in steps if s > 2 and not {s - 1, s - 2} & set(saves))
slow = {s: round(steps[s]["step_time"] - normal, 1) for s in steps if s > 1 and steps[s]["step_time"] > normal + 0.5}
print(f"median step {normal:.2f} s; steps over 0.5 s slower (step: extra s): {slow}")
for step, (blocked, on_write, on_buffers, copy) in sorted(saves.items()):
    extra = sum(max(0.0, steps[s]["step_time"] - normal) for s in (step + 1, step + 2, step + 3) if s in steps)
    print(f"save at step {step}: training blocked {blocked:.1f} s, of which {on_write:.1f} s waiting for the previous "
          f"write, {on_buffers:.1f} s for the host buffers and {copy:.1f} s copying to host; + {extra:.1f} s slower "
          "steps after it")
PY
      if [ -z "${SKIP_RESUME:-}" ]; then  # resume from the last (synchronous) checkpoint: 1 more step
        rm -f runs/bench/p7b-ckpt-async/finished
        RUN_TIMEOUT=${RUN_TIMEOUT:-420} train p7b-ckpt-async-resumed "${CK[@]}" train.run_name=p7b-ckpt-async \
          train.max_steps=$((2 * ${EVERY:-5} + 3)) checkpoint.enabled=false
        grep -E "resumed" "$LOGS/p7b-ckpt-async-resumed.log"
      fi
      rm -rf runs/bench/p7b-ckpt-async/checkpoints ;;
    twonode)  # 2 "nodes" x 2 GPUs through slurm/train.slurm, HSDP; then the same global batch on 4 GPUs, FSDP
      python3 scripts/demo_data.py --out data/demo >/dev/null
      shims=$(mktemp -d)
      printf '#!/bin/bash\nprintf "node1\\nnode2\\n"\n' >"$shims/scontrol"
      printf '#!/bin/bash\necho "$(hostname) $2"\n' >"$shims/getent"
      cat >"$shims/srun" <<'SH'
#!/bin/bash
while [[ "$1" == --* ]]; do shift; done
CUDA_VISIBLE_DEVICES=0,1 "$@" >runs/bench/logs/twonode-node0.log 2>&1 & a=$!
CUDA_VISIBLE_DEVICES=2,3 "$@" >runs/bench/logs/twonode-node1.log 2>&1 & b=$!
wait $a; x=$?; wait $b; y=$?; exit $(( x > y ? x : y ))
SH
      chmod +x "$shims"/*
      TWO=(train.max_steps=20 fsdp.param_dtype=bfloat16 checkpoint.enabled=false checkpoint.export_hf=false
           train.output_dir=runs/bench eval.every_steps=0)
      PATH="$shims:$PATH" SLURM_JOB_NUM_NODES=2 SLURM_JOB_NODELIST="node[1-2]" SLURM_JOB_ID=4242 GPUS_PER_NODE=2 \
        OMP_NUM_THREADS=4 timeout 300 bash slurm/train.slurm configs/demo.yaml "${TWO[@]}" train.run_name=twonode-hsdp \
        fsdp.replicate_degree=2 >"$LOGS/twonode-hsdp.log" 2>&1; echo "twonode-hsdp: exit $?"
      train twonode-fsdp configs/demo.yaml "${TWO[@]}" train.run_name=twonode-fsdp
      python3 - <<'PY'
from pathlib import Path
from sft.training.metrics import read_metrics
a, _ = read_metrics(Path("runs/bench/twonode-hsdp")); b, _ = read_metrics(Path("runs/bench/twonode-fsdp"))
worst = max(abs(a[s]["loss"] - b[s]["loss"]) / b[s]["loss"] for s in b)
print(f"2 nodes x 2 GPUs HSDP vs 4 GPUs FSDP, {len(b)} steps: largest relative loss difference {worst:.2e}; "
      f"final {a[max(a)]['loss']:.4f} vs {b[max(b)]['loss']:.4f}")
PY
      ;;
    moe30b)  # our runs and the peer's on one checkpoint's shapes (the peer needs the weights on disk)
      p7b_data
      moe=$(moe_standin)
      ac_runs moe30b <<RUNS
moe30b-${MOE_BLOCKS:-10}b-ac0 configs/bench/p7b.yaml model.name_or_path=$moe ac.ratio=0
moe30b-${MOE_BLOCKS:-10}b-ac1 configs/bench/p7b.yaml model.name_or_path=$moe ac.ratio=1
RUNS
      moe_loads runs/bench/moe30b-*
      peer_moe "$moe" 2 ${PEER_AC:-full none} ;;
    ep30b)  # issue #36: the stand-in with expert parallelism (ep 2) and without, 2 and 4 rows per GPU, and the peer
      p7b_data
      moe=$(moe_standin)
      ac_runs ep30b <<RUNS
ep30b-ep1-mb4 configs/bench/p7b.yaml model.name_or_path=$moe ac.ratio=0 train.micro_batch_size=4
ep30b-ep2-mb4 configs/bench/p7b.yaml model.name_or_path=$moe ac.ratio=0 train.micro_batch_size=4 moe.ep_degree=$NGPU ${TRACE:+logging.profile_steps=[9,10]}
ep30b-ep2-mb2 configs/bench/p7b.yaml model.name_or_path=$moe ac.ratio=0 moe.ep_degree=$NGPU
RUNS
      moe_loads runs/bench/ep30b-*
      for bs in ${PEER_BS:-4 2}; do peer_moe "$moe" "$bs" ${PEER_AC:-none}; done ;;
    moonlight)  # issue #46, for 2 GPUs: DeepSeek-V3 routing at Moonlight-16B-A3B's shapes (random init, P-7B rows):
      # MOONLIGHT_BLOCKS of its 27 blocks with fp32 state, and the whole model under plan.auto (lean state allowed)
      p7b_data 4
      ml=$(moonlight_standin)
      ac_runs moonlight <<RUNS
moonlight-blocks-mb4 configs/bench/p7b.yaml model.name_or_path=$ml ac.ratio=0 train.micro_batch_size=4
moonlight-whole-auto configs/bench/p7b.yaml model.name_or_path=configs/models/moonlight-16b-a3b plan.auto=true plan.allow_lean_state=true
RUNS
      moe_loads runs/bench/moonlight-* ;;
    lora)
      p7b_data
      LORA="lora.rank=16 lora.alpha=32" TRACED=${TRACE:+logging.profile_steps=[9,10]}
      ac_runs lora <<RUNS
lora-p7b-ac1    configs/bench/p7b.yaml $LORA ac.ratio=1
lora-p7b-auto   configs/bench/p7b.yaml $LORA plan.auto=true $TRACED
lora-p7b-f8-auto  configs/bench/p7b.yaml $LORA plan.auto=true precision.float8=tensorwise $TRACED
lora-p7b-f8r-auto configs/bench/p7b.yaml $LORA plan.auto=true precision.float8=rowwise
qlora-p7b-ac1   configs/bench/p7b.yaml $LORA lora.base=nf4 ac.ratio=1
qlora-p7b-auto  configs/bench/p7b.yaml $LORA lora.base=nf4 plan.auto=true
RUNS
      if [ -n "${PEER_DIR:-}" ]; then  # the peer's LoRA rows, same workload, same GPUs, same call
        OUT=$LOGS/peer NGPU=$NGPU VARIANTS=${PEER_VARIANTS:-liger_lora noac_liger_lora liger_qlora} \
          bash "$PEER_DIR/run_trl_fixed.sh" | tee -a runs/bench/lora.md
      fi ;;
    lora30b)  # issue #46, one GPU: the whole Qwen3-30B-A3B (random init), LoRA rank 16 on the attention and on every
      # routed expert (lora.target_modules=[all-linear,experts]), P-7B rows: plan.auto, then mb 2 with every block
      # checkpointed (ONLY=regex picks); then the peer, TRL + peft's target_parameters on the same adapters
      # (scripts/trl_moe_bench.py --lora 16, full AC, one GPU without FSDP) at PEER_BS rows (default "2 4")
      p7b_data
      L30B="configs/bench/p7b.yaml model.name_or_path=configs/models/qwen3-30b-a3b lora.rank=16 lora.alpha=32 \
lora.target_modules=[all-linear,experts] optim.lr=2e-4"
      ac_runs lora30b <<RUNS
lora30b-auto $L30B plan.auto=true ${TRACE:+logging.profile_steps=[9,10]}
lora30b-mb2-ac1 $L30B train.micro_batch_size=2 ac.ratio=1
RUNS
      for bs in ${PEER_BS:-2 4}; do
        log=$LOGS/trl-lora30b-bs$bs.log
        timeout "${RUN_TIMEOUT:-300}" python3 scripts/trl_moe_bench.py train --model configs/models/qwen3-30b-a3b \
          --random --lora 16 --bs "$bs" --steps "$STEPS" >"$log" 2>&1
        echo "trl-lora30b-bs$bs: exit $?"
        if grep -q RESULT "$log"; then grep RESULT "$log" | tee -a runs/bench/lora30b.md
        else grep -iE "error|out of memory" "$log" | tail -3; fi
      done ;;
    loragptoss)  # issue #59, one GPU: gpt-oss-20b (random init), LoRA rank 16 on q/k/v/o and every routed expert,
      # P-7B rows, flex attention (its sinks), plan.auto; then the peer on the same adapters (scripts/trl_moe_bench.py
      # --lora 16, transformers' default attention, one GPU) at PEER_BS rows (default 2), full AC
      p7b_data
      ac_runs loragptoss <<RUNS
loragptoss-auto configs/bench/p7b.yaml model.name_or_path=configs/models/gpt-oss-20b model.attn_implementation=flex_attention lora.rank=16 lora.alpha=32 lora.target_modules=[q_proj,k_proj,v_proj,o_proj,experts] optim.lr=2e-4 plan.auto=true ${TRACE:+logging.profile_steps=[9,10]}
RUNS
      for bs in ${PEER_BS:-2}; do
        log=$LOGS/trl-loragptoss-bs$bs.log
        timeout "${RUN_TIMEOUT:-300}" python3 scripts/trl_moe_bench.py train --model configs/models/gpt-oss-20b \
          --random --lora 16 --bs "$bs" --steps "$STEPS" >"$log" 2>&1
        echo "trl-loragptoss-bs$bs: exit $?"
        if grep -q RESULT "$log"; then grep RESULT "$log" | tee -a runs/bench/loragptoss.md
        else grep -iE "error|out of memory" "$log" | tail -3; fi
      done ;;
    lora35moe)  # issue #58, one GPU: the whole Qwen3.5-35B-A3B (configs/models/qwen3.5-35b-a3b: transformers'
      # qwen3_5_moe_text defaults), random init, LoRA rank 16 on q/k/v/o and every routed expert, P-7B rows:
      # plan.auto, then mb 2 with every block checkpointed (ONLY=regex picks); then the peer on the same adapters
      # (scripts/trl_moe_bench.py --lora 16, one GPU) at PEER_BS rows (default 2) with PEER_AC (default "full none")
      python3 -c "import fla, tilelang" || { echo "lora35moe needs fla-core and tilelang (see qwen35)"; exit 1; }
      p7b_data
      L35="configs/bench/p7b.yaml model.name_or_path=configs/models/qwen3.5-35b-a3b lora.rank=16 lora.alpha=32 \
lora.target_modules=[q_proj,k_proj,v_proj,o_proj,experts] optim.lr=2e-4"
      ac_runs lora35moe <<RUNS
lora35moe-auto $L35 plan.auto=true ${TRACE:+logging.profile_steps=[9,10]}
lora35moe-mb2-ac1 $L35 train.micro_batch_size=2 ac.ratio=1
RUNS
      for bs in ${PEER_BS:-2}; do
        for ac in ${PEER_AC:-full none}; do
          log=$LOGS/trl-lora35moe-bs$bs-ac$ac.log
          timeout "${RUN_TIMEOUT:-300}" python3 scripts/trl_moe_bench.py train --model configs/models/qwen3.5-35b-a3b \
            --random --lora 16 --bs "$bs" --ac "$ac" --steps "$STEPS" >"$log" 2>&1
          echo "trl-lora35moe-bs$bs-ac$ac: exit $?"
          if grep -q RESULT "$log"; then grep RESULT "$log" | tee -a runs/bench/lora35moe.md
          else grep -iE "error|out of memory" "$log" | tail -3; fi
        done
      done ;;
    acoffload)  # issue #60, one GPU: ac.offload (the checkpointed blocks' inputs in host memory) against the same run
      # keeping them on the GPU: P-7B's model with LoRA rank 16 on rows of OFFLOAD_LEN tokens (default 32768), mb 1, ac 1
      python3 scripts/synthetic_tokens.py --out data/bench/long.parquet --samples $((NGPU * STEPS)) --length "${OFFLOAD_LEN:-32768}"
      LONGROWS="configs/bench/p7b.yaml data.path=data/bench/long.parquet data.max_seq_len=${OFFLOAD_LEN:-32768} \
train.micro_batch_size=1 lora.rank=16 lora.alpha=32 ac.ratio=1"
      ac_runs acoffload <<RUNS
acoffload-off $LONGROWS
acoffload-on $LONGROWS ac.offload=true
RUNS
      ;;
    tiledmlp)  # issue #60, one GPU: ac.mlp_tile_tokens (the dense MLPs a tile of TILE (16384) tokens at a time) against
      # the same run untiled: P-7B's model with LoRA rank 16 on rows of TILE_LEN tokens (default 131072), mb 1, ac 1
      python3 scripts/synthetic_tokens.py --out data/bench/long.parquet --samples $((NGPU * STEPS)) --length "${TILE_LEN:-131072}"
      LONGROWS="configs/bench/p7b.yaml data.path=data/bench/long.parquet data.max_seq_len=${TILE_LEN:-131072} \
train.micro_batch_size=1 lora.rank=16 lora.alpha=32 ac.ratio=1"
      ac_runs tiledmlp <<RUNS
tiledmlp-off $LONGROWS
tiledmlp-on $LONGROWS ac.mlp_tile_tokens=${TILE:-16384}
RUNS
      ;;
    longrow)  # issue #60, one GPU: the longest rows the goals name, every block checkpointed with its input in host
      # memory (ac.offload), mb 1, LoRA rank 16: Qwen3.5-9B at 256k tokens (needs fla-core + tilelang; predicted 72.3
      # GiB, 139.5 without offload) and the whole Qwen3-30B-A3B (attention + routed experts) at 128k (92.9 GiB);
      # run with STEPS=3 and ONLY=one of them per call: a 256k step takes a minute or more, a call at most 10
      python3 scripts/synthetic_tokens.py --out data/bench/len256k.parquet --samples $((NGPU * STEPS)) --length 262144
      python3 scripts/synthetic_tokens.py --out data/bench/len128k.parquet --samples $((NGPU * STEPS)) --length 131072
      ROWS="configs/bench/p7b.yaml train.micro_batch_size=1 lora.rank=16 lora.alpha=32 ac.ratio=1 ac.offload=true"
      WARMUP=1 RUN_TIMEOUT=${RUN_TIMEOUT:-540} ac_runs longrow <<RUNS
longrow-q35-9b-256k $ROWS model.name_or_path=configs/models/qwen3.5-9b data.path=data/bench/len256k.parquet data.max_seq_len=262144
longrow-q30b-128k $ROWS model.name_or_path=configs/models/qwen3-30b-a3b data.path=data/bench/len128k.parquet data.max_seq_len=131072 lora.target_modules=[all-linear,experts]
RUNS
      ;;
    qlora30b)  # issue #46, one GPU: lora30b's adapters with the base in NF4, the routed experts' too (lora.base=nf4):
      # plan.auto within an 80 GB card's memory (plan.gpu_mem_gib=80), then mb 2 with every block checkpointed
      p7b_data
      Q30B="configs/bench/p7b.yaml model.name_or_path=configs/models/qwen3-30b-a3b lora.rank=16 lora.alpha=32 \
lora.target_modules=[all-linear,experts] optim.lr=2e-4 lora.base=nf4"
      ac_runs qlora30b <<RUNS
qlora30b-auto80 $Q30B plan.auto=true plan.gpu_mem_gib=80
qlora30b-mb2-ac1 $Q30B train.micro_batch_size=2 ac.ratio=1
RUNS
      ;;
    qwen35)
      python3 -c "import fla, tilelang" || { echo "qwen35 needs fla-core and tilelang (see above)"; exit 1; }
      if [ "${PROBE:-1}" = 1 ]; then
        for shapes in qwen3.5-9b qwen3.5-27b; do
          timeout 300 python3 scripts/bench_block_memory.py configs/models/$shapes --modes ${PROBE_MODES:-eager compiled} \
            2>"$LOGS/layers-$shapes.log"
        done | tee runs/bench/qwen35-layers.jsonl
      fi
      p7b_data
      python3 scripts/synthetic_tokens.py --out data/bench/v7b.parquet --samples 4000 --lognormal 600 0.8
      Q35="model.name_or_path=configs/models/qwen3.5-9b"
      PACKED="data.packing=true train.micro_batch_size=2"  # sdpa: Qwen3.5 has no flex attention in transformers 5.17
      ac_runs qwen35 <<RUNS
qwen35-p7b-ac1          configs/bench/p7b.yaml $Q35 ac.ratio=1
qwen35-p7b-ac0.5        configs/bench/p7b.yaml $Q35 ac.ratio=0.5
qwen35-p7b-mb1-ac0      configs/bench/p7b.yaml $Q35 train.micro_batch_size=1 train.grad_accum_steps=2 ac.ratio=0
qwen35-v7b-packed-ac1   configs/bench/v7b.yaml $Q35 $PACKED ac.ratio=1
qwen35-p7b-auto         configs/bench/p7b.yaml $Q35 plan.auto=true
qwen35-v7b-packed-auto  configs/bench/v7b.yaml $Q35 $PACKED plan.auto=true
qwen35-p7bf8-auto       configs/bench/p7b.yaml $Q35 plan.auto=true precision.float8=tensorwise
qwen35-v7bf8-packed-auto configs/bench/v7b.yaml $Q35 $PACKED plan.auto=true precision.float8=tensorwise
RUNS
      ;;
    qwen35peer)
      python3 -c "import fla, tilelang, liger_kernel" || { echo "qwen35peer needs fla-core, tilelang, liger_kernel"; exit 1; }
      [ "${PEER_VARIANTS:-}" = none ] || OUT=$LOGS/peer NGPU=$NGPU MODEL=hf:qwen3_5_text \
        VARIANTS=${PEER_VARIANTS:-noac_liger liger} bash "$PEER_DIR/run_trl_fixed.sh" | tee -a runs/bench/qwen35peer.md
      [ "${PEER_VARLEN:-}" = none ] || OUT=$LOGS/peer NGPU=$NGPU MODEL=hf:qwen3_5_text VARIANTS=${PEER_VARLEN:-pack2} \
        bash "$PEER_DIR/run_trl_varlen.sh" | tee -a runs/bench/qwen35peer.md ;;
    qwen35big)
      p7b_data
      ac_runs qwen35big <<RUNS
qwen35-27b-auto configs/bench/p7b.yaml model.name_or_path=configs/models/qwen3.5-27b plan.auto=true plan.allow_lean_state=true
RUNS
      ;;
    qlora72b)
      p7b_data
      ac_runs qlora72b <<RUNS
qlora72b-ac1 configs/qwen72b_qlora.yaml $LORA72B
RUNS
      ;;
    lora72b)
      p7b_data
      ac_runs lora72b <<RUNS
lora72b-ac1 configs/qwen72b_qlora.yaml $LORA72B lora.base=bfloat16
RUNS
      ;;
    startup)
      p7b_data
      caches=$(mktemp -d)
      # a checkpoint as transformers saves it (30.5 GB, one tensor per expert): our load next to from_pretrained's,
      # bit for bit the same weights; then the load30b-24 runs below start from it
      [[ "load30b-24" =~ ${ONLY:-.} ]] && python3 scripts/bench_load.py /tmp/qwen3-30b-a3b-24 \
        --preset qwen3-30b-a3b-24 --device cuda --repeats 2 --threads 4 8 2>&1 | grep -E "GB on|Error"
      # a random P-7B checkpoint (15 GB as transformers saves it; the peer's own maker with PEER_DIR set): ours
      # (lora-p7b-files) and TRL's start from it
      peer_model=/tmp/peer-model-qwen2.5-7b
      if [[ "lora-p7b-files" =~ ${ONLY:-.} ]] && [ ! -d $peer_model ]; then
        if [ -n "${PEER_DIR:-}" ]; then python3 "$PEER_DIR/make_model.py" qwen2.5-7b $peer_model | tail -1
        else python3 scripts/save_random_checkpoint.py configs/models/qwen2.5-7b $peer_model --device cuda | tail -1; fi
      fi
      while read -r name config overrides; do
        [[ "$name" =~ ${ONLY:-.} ]] || continue
        for launch in cold warm; do
          # shellcheck disable=SC2086
          train "startup-$name-$launch" "$config" $overrides train.max_steps=2 compile.cache_dir="$caches/$name" </dev/null
          grep -E "start-up and step 1 took" "$LOGS/startup-$name-$launch.log"
        done
      done <<RUNS
lora-p7b configs/bench/p7b.yaml lora.rank=16 lora.alpha=32 ac.ratio=1
lora30b configs/bench/p7b.yaml model.name_or_path=configs/models/qwen3-30b-a3b lora.rank=16 lora.alpha=32 lora.target_modules=[all-linear,experts] train.micro_batch_size=2 ac.ratio=1
lora-qwen35-9b configs/bench/p7b.yaml model.name_or_path=configs/models/qwen3.5-9b lora.rank=16 lora.alpha=32 plan.auto=true
load30b-24 configs/bench/p7b.yaml model.name_or_path=/tmp/qwen3-30b-a3b-24 model.init=pretrained lora.rank=16 lora.alpha=32 lora.target_modules=[all-linear,experts] train.micro_batch_size=2 ac.ratio=1
lora-p7b-files configs/bench/p7b.yaml model.name_or_path=/tmp/peer-model-qwen2.5-7b model.init=pretrained lora.rank=16 lora.alpha=32 ac.ratio=1
RUNS
      # the peer on the same files and rows: TRL + peft + Liger, LoRA rank 16 on every Linear, full AC (its variant
      # that fits the P-7B rows on one GPU), launch -> exit after step 2, twice; TRL compiles nothing, so "warm"
      # differs from "cold" only by the page cache and Python's bytecode cache
      if [ -n "${PEER_DIR:-}" ] && [[ "lora-p7b-files" =~ ${ONLY:-.} ]]; then
        for launch in cold warm; do  # TRL, Liger and datasets: the wheels installed above (/tmp/site)
          t0=$(date +%s.%N)
          TOKENIZERS_PARALLELISM=false timeout "${RUN_TIMEOUT:-300}" torchrun \
            --standalone --nproc_per_node 1 "$PEER_DIR/trl_sft_bench.py" --model $peer_model --seq 4096 --bs 2 \
            --steps 2 --warmup 0 --lora 16 --liger > "$LOGS/startup-peer-lora-p7b-$launch.log" 2>&1
          echo "startup-peer-lora-p7b-$launch: exit $? in $(python3 -c "print(round($(date +%s.%N) - $t0))") s" \
            "(launch -> exit after step 2; trainer.train() $(grep -o '"wall_s": [0-9.]*' \
            "$LOGS/startup-peer-lora-p7b-$launch.log" | cut -d' ' -f2) s)"
        done
      fi
      ;;
    images)
      python3 -c "import fla, tilelang" || { echo "images needs fla-core and tilelang (see qwen35)"; exit 1; }
      python3 -c "import torchvision; print('torchvision', torchvision.__version__)" 2>&1 | tail -1
      q35vl=/tmp/qwen3.5-9b-vl
      mkdir -p "$q35vl-files" && cp configs/models/qwen3.5-9b-vl/* "$q35vl-files/" &&
        cp configs/demo_vlm/model/{tokenizer.json,tokenizer_config.json,chat_template.jinja} "$q35vl-files/"
      [ -f "$q35vl/config.json" ] || hf_checkpoint "$q35vl-files" "$q35vl"
      images=data/bench/images${IMAGE_VARLEN:+_varlen}
      sigma=0; [ -z "${IMAGE_VARLEN:-}" ] || sigma=0.8
      (cd scripts && python3 image_bench_data.py --out "../$images" --rows $((NGPU * 8 * (STEPS + 8))) --sigma $sigma)
      if [ -n "${IMAGE_VARLEN:-}" ]; then ac_runs images <<RUNS
images-packed-q35-9b-auto configs/bench/images.yaml model.name_or_path=$q35vl data.path=$images/train.jsonl data.packing=true data.max_seq_len=8192 train.micro_batch_size=1 plan.auto=true
RUNS
      else ac_runs images <<RUNS
images-lora-q35-9b configs/bench/images.yaml model.name_or_path=$q35vl
images-lora-q35-9b-auto configs/bench/images.yaml model.name_or_path=$q35vl plan.auto=true
RUNS
      fi
      # the peer on the same files and rows (scripts/trl_vlm_bench.py: TRL's SFTTrainer with the processor, peft LoRA
      # on the same layers): each variant of VLM_PEER ("noac", "noac_liger", "ac", "ac_liger"; default all four)
      for variant in ${VLM_PEER-noac noac_liger ac ac_liger}; do
        log="$LOGS/trl-vlm-$variant.log"
        ac=none; [[ $variant == ac* ]] && ac=full
        liger=(); [[ $variant == *liger ]] && liger=(--liger)
        TOKENIZERS_PARALLELISM=false timeout "${RUN_TIMEOUT:-300}" python3 scripts/trl_vlm_bench.py --model "$q35vl" \
          --data "$images/train.jsonl" --bs 8 --steps "$STEPS" --ac "$ac" "${liger[@]}" >"$log" 2>&1
        echo "trl-vlm-$variant: exit $?"
        if grep -q RESULT "$log"; then grep RESULT "$log" | tee -a runs/bench/images.md
        else grep -iE "error|out of memory" "$log" | tail -3; fi
      done ;;
    summary)
      python3 scripts/bench_summary.py runs/bench/*/ --warmup 4 | tee runs/bench/summary.md ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
if [ -n "${OUT:-}" ]; then
  tar czf "$OUT/bench.tgz" --exclude='*.json.gz' --exclude='*.pickle' runs/bench && cp runs/bench/summary.md "$OUT/" 2>/dev/null
  for trace in runs/bench/*/profile/trace-rank0.json.gz; do  # profiler traces travel separately if small
    [ -f "$trace" ] && [ "$(stat -c %s "$trace")" -lt 15000000 ] && cp "$trace" "$OUT/$(basename "$(dirname "$(dirname "$trace")")").trace.json.gz"
  done
fi
exit 0
