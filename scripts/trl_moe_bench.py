"""The peer on the MoE workload: TRL's SFTTrainer + accelerate FSDP2 + transformers 5 (its default
grouped_mm experts and its own load-balancing loss), on the same shapes and data as `sft`'s moe30b stage.

    python scripts/trl_moe_bench.py make-model CONFIG_DIR OUT_DIR        # random bf16 checkpoint
    torchrun --nproc_per_node N scripts/trl_moe_bench.py train --model OUT_DIR [--ac full|none]
    python scripts/trl_moe_bench.py train --model CONFIG_DIR --random --lora 16   # LoRA on one GPU

--lora R: peft's LoRA of rank R (alpha 2R, no dropout) on the attention projections and on each routed
expert (target_parameters experts.gate_up_proj / experts.down_proj, peft >= 0.17), the base frozen in bf16:
the adapters `sft` trains with lora.target_modules=[all-linear, experts] on Qwen3-MoE, parameter for
parameter (peft 0.21.2's "all-linear" also adapts the router and gives gate_up_proj rank 2R, as measured).
One GPU runs without FSDP. --random builds the model from CONFIG_DIR's config.json with random bf16
weights on the GPU (no checkpoint on disk: the whole 30B's 61 GB would not fit a one-GPU machine's disk).

Workload: every sample SEQ random token ids, loss on the second half, BS samples per GPU, grad-acc 1,
routing computed by the model's router (no fake balancing). Weights load as bf16 (TRL's usual setup:
no float32 master copy, unlike `sft`). Rank 0 prints one line 'RESULT {json}': tok_s_gpu (tokens
per second per GPU, steady state after --warmup steps), step_s, peak_mem_gib, the first and last losses.
Needs trl and datasets (scripts/bench_gpu.sh installs the wheels in .whl/). Without GPUs `train` runs
in one process in float32 without FSDP: a dry run of this script (e.g. --seq 128 --steps 4), not a peer.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def make_model(config_dir: str, out: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir), dtype=torch.bfloat16)
    model.save_pretrained(out)  # transformers 5 writes the hub layout (one tensor per expert)
    print(f"saved {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters to {out}")


def train(args: argparse.Namespace) -> None:
    from datasets import Dataset
    from tokenizers import Tokenizer, models
    from transformers import AutoConfig, PreTrainedTokenizerFast, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.ends: list[float] = []

        def on_step_end(self, *_, **__):
            if gpu:
                torch.cuda.synchronize()
            self.ends.append(time.perf_counter())

    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    gpu = torch.cuda.is_available()  # without GPUs: one process, no FSDP, float32 (a dry run of this script)
    fsdp = gpu and world > 1
    config = AutoConfig.from_pretrained(args.model)
    samples = args.bs * world * (args.steps + 1)
    ids = torch.randint(2, config.vocab_size, (samples, args.seq), generator=torch.Generator().manual_seed(0))
    half = args.seq // 2
    data = Dataset.from_dict({"input_ids": ids.tolist(),
                              "completion_mask": [[0] * half + [1] * (args.seq - half)] * samples})
    # A word-level tokenizer with only a pad token: the data is already token ids.
    words = models.WordLevel({"<pad>": 0, "<unk>": 1}, unk_token="<unk>")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(words),
                                        pad_token="<pad>", unk_token="<unk>", eos_token="<pad>")
    layer = config.architectures[0].replace("ForCausalLM", "DecoderLayer")
    # The model computes its load-balancing loss (output_router_logits) and adds it to the loss.
    init = {"dtype": torch.bfloat16 if gpu else torch.float32, "output_router_logits": True,
            **({"experts_implementation": args.experts} if args.experts else {})}
    model = args.model
    if args.random:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        config.output_router_logits = init.pop("output_router_logits")
        with torch.device(f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if gpu else "cpu"):  # each rank on its GPU
            model = AutoModelForCausalLM.from_config(config, **init)
    peft_config = None
    if args.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=args.lora, lora_alpha=2 * args.lora, lora_dropout=0.0, task_type="CAUSAL_LM",
                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                 target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    sft_config = SFTConfig(
        output_dir="/tmp/trl_moe_out", per_device_train_batch_size=args.bs, gradient_accumulation_steps=1,
        max_steps=args.steps, learning_rate=2e-4 if args.lora else 1e-5, lr_scheduler_type="constant", bf16=gpu,
        use_cpu=not gpu, logging_steps=1, save_strategy="no", report_to=[], max_length=args.seq, packing=False,
        completion_only_loss=True, dataloader_num_workers=0, seed=0, fsdp="full_shard auto_wrap" if fsdp else "",
        # TRL turns gradient checkpointing on by default; with FSDP, its own activation_checkpointing does it.
        gradient_checkpointing=not fsdp and args.ac == "full",
        fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": [layer], "reshard_after_forward": True,
                     "activation_checkpointing": args.ac == "full", "state_dict_type": "SHARDED_STATE_DICT"}
        if fsdp else None,
        model_init_kwargs=None if args.random else init)
    timer = StepTimes()
    trainer = SFTTrainer(model=model, args=sft_config, train_dataset=data, processing_class=tokenizer,
                         callbacks=[timer], peft_config=peft_config)
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    steady = timer.ends[args.warmup:]
    step_s = (steady[-1] - steady[0]) / (len(steady) - 1)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if rank == 0:
        print("RESULT " + json.dumps({
            "peer": "trl", "world": world, "seq": args.seq, "bs": args.bs, "ac": args.ac,
            "experts": args.experts or "default", "lora": args.lora,
            "trained_parameters": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
            "step_s": step_s, "tok_s_gpu": args.bs * args.seq / step_s,
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if gpu else None,
            "loss_first": losses[:3], "loss_last": losses[-3:]}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("make-model", help="write a random bf16 checkpoint of CONFIG_DIR's shapes")
    make.add_argument("config_dir")
    make.add_argument("out")
    run = commands.add_parser("train", help="the timed TRL run (under torchrun)")
    run.add_argument("--model", required=True, help="a checkpoint from make-model")
    run.add_argument("--seq", type=int, default=4096)
    run.add_argument("--bs", type=int, default=2)
    run.add_argument("--steps", type=int, default=15)
    run.add_argument("--warmup", type=int, default=5)
    run.add_argument("--ac", choices=["full", "none"], default="full")
    run.add_argument("--lora", type=int, default=0, help="peft LoRA rank on the Linear layers and the routed experts")
    run.add_argument("--random", action="store_true", help="--model is a config dir: random weights, built here")
    run.add_argument("--experts", help="transformers' experts_implementation (default: its own choice, grouped_mm "
                                       "on GPUs)")
    args = parser.parse_args()
    if args.command == "make-model":
        make_model(args.config_dir, args.out)
    else:
        train(args)


if __name__ == "__main__":
    main()
