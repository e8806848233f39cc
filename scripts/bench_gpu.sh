#!/usr/bin/env bash
# Reproduce the GPU rows of docs/BENCHMARKS.md on one host:  bash scripts/bench_gpu.sh STAGE...
#   info      cards, driver, versions
#   smoke     the demo on all GPUs (bf16), 20 steps
#   ckpt7b    save a random Qwen2.5-7B-shaped HF checkpoint to $CKPT7B (bf16 safetensors)
#   fsdp      P-7B through the real loading path: ac.ratio 0 / 0.5 / 1, compile on and off
#   ckpt      7B checkpoint save / resume / HF export times
#   knobs     P-7B: bf16 reduce, ZeRO-2, deferred gradient sync with grad-acc 4
#   packing   V-7B: padded vs packed (flex attention)
#   summary   one table of all runs
# Results: runs/bench/<name>/metrics.jsonl and logs; with $OUT set, a tarball + summary there.
set -u
cd "$(dirname "$0")/.."
if [ -d .whl ]; then  # the GPU image lacks `datasets`: wheels carried in .whl/
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
NGPU=${NGPU:-$(nvidia-smi -L | wc -l)}
CKPT7B=${CKPT7B:-/tmp/qwen2.5-7b-random}
STEPS=${STEPS:-12}
LOGS=runs/bench/logs
mkdir -p "$LOGS"

train() {  # train NAME CONFIG OVERRIDES...  (later overrides win, so OVERRIDES may rename the run)
  local name=$1 config=$2; shift 2
  local t0=$SECONDS
  timeout "${RUN_TIMEOUT:-300}" torchrun --standalone --nproc_per_node "$NGPU" train.py --config "$config" \
    train.run_name="$name" "$@" >"$LOGS/$name.log" 2>&1
  echo "$name: exit $? in $((SECONDS - t0)) s"; cp -f runs/bench/"$name"/metrics.jsonl "$LOGS/$name.metrics.jsonl" 2>/dev/null; grep -E "start-up|RSS|^\[.*step (1|$STEPS)/|Error|error" "$LOGS/$name.log" | tail -4
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
      t0=$SECONDS; python3 scripts/save_random_checkpoint.py configs/models/qwen2.5-7b "$CKPT7B" --device cuda
      echo "saved in $((SECONDS - t0)) s"; du -sh "$CKPT7B" ;;
    fsdp)
      python3 scripts/synthetic_tokens.py --out data/bench/p7b.parquet --samples $((NGPU * 2 * STEPS)) --length 4096
      for compile in true false; do for ratio in 1 0.5 0; do
        train "p7b-compile-$compile-ac$ratio" configs/bench/p7b.yaml model.name_or_path="$CKPT7B" \
          model.init=pretrained compile.enabled=$compile ac.ratio=$ratio train.max_steps="$STEPS"
      done; done ;;
    ckpt)  # save + resume + export times for the 7B model (needs ckpt7b)
      python3 scripts/synthetic_tokens.py --out data/bench/p7b.parquet --samples $((NGPU * 2 * 16)) --length 4096
      P7B=(configs/bench/p7b.yaml model.name_or_path="$CKPT7B" model.init=pretrained train.overwrite=false)
      train p7b-ckpt "${P7B[@]}" train.max_steps=8 checkpoint.export_hf=true
      grep -E "saved|exported" "$LOGS/p7b-ckpt.log"
      rm -f runs/bench/p7b-ckpt/finished  # continue the same run: resume + 2 more steps
      train p7b-ckpt-resumed "${P7B[@]}" train.run_name=p7b-ckpt train.max_steps=10
      grep -E "resumed|saved" "$LOGS/p7b-ckpt-resumed.log"
      du -sh runs/bench/p7b-ckpt/checkpoints/* runs/bench/p7b-ckpt/export; rm -rf runs/bench/p7b-ckpt/checkpoints ;;
    knobs)  # one change at a time against the compile + ac 0 baseline
      python3 scripts/synthetic_tokens.py --out data/bench/p7b.parquet --samples $((NGPU * 8 * STEPS)) --length 4096
      P7B=(configs/bench/p7b.yaml model.name_or_path="$CKPT7B" model.init=pretrained train.max_steps="$STEPS")
      train p7b-base "${P7B[@]}"
      train p7b-bf16-reduce "${P7B[@]}" fsdp.reduce_dtype=bfloat16
      train p7b-zero2 "${P7B[@]}" fsdp.reshard_after_forward=false
      train p7b-ga4-sync "${P7B[@]}" train.grad_accum_steps=4 train.max_steps=8
      train p7b-ga4-nosync "${P7B[@]}" train.grad_accum_steps=4 train.max_steps=8 fsdp.sync_grads_each_microbatch=false ;;
    packing)  # workload V-7B: padded to the longest vs packed rows with flex attention
      python3 scripts/synthetic_tokens.py --out data/bench/v7b.parquet --samples 4000 --lognormal 600 0.8
      train v7b-padded configs/bench/v7b.yaml train.max_steps="$STEPS"
      train v7b-packed configs/bench/v7b.yaml train.max_steps="$STEPS" data.packing=true train.micro_batch_size=2 \
        model.attn_implementation=flex_attention ;;
    summary)
      python3 scripts/bench_summary.py runs/bench/*/ --warmup 4 | tee runs/bench/summary.md ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
if [ -n "${OUT:-}" ]; then
  tar czf "$OUT/bench.tgz" runs/bench && cp runs/bench/summary.md "$OUT/" 2>/dev/null
fi
exit 0
