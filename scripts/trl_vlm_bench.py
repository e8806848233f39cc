"""The peer on the image workload: TRL's SFTTrainer with the checkpoint's processor (its own
vision-language collator: the processor renders each row's picture and text), peft LoRA, on the same
rows and random checkpoint as `sft`'s images stage (scripts/bench_gpu.sh images).

    python scripts/trl_vlm_bench.py --model /tmp/qwen3.5-9b-vl --data data/bench/images/train.jsonl \
        --bs 8 --ac none [--liger]

The model: transformers' vision-language class of the checkpoint in bf16 (TRL's usual setup), its
vision tower frozen; LoRA of rank --lora (alpha 2R, no dropout) on the language model's Linear layers,
the layers `sft` adapts with lora.target_modules=all-linear. The processor: Qwen3-VL's (what Qwen3.5
checkpoints ship), from the checkpoint's tokenizer, chat template and image processor. Rows as
prompt (a user turn: the picture, then the question) and completion (the reply), loss on the
completion, padded per batch. One GPU, no FSDP. Rank 0 prints one line 'RESULT {json}': tok_s_gpu
(all tokens of the padded batches, image tokens included, per second, steady state after --warmup
steps), the non-pad tokens per second, step_s, peak_mem_gib, the first and last losses.
Needs trl, datasets and torchvision (the processor's video half); scripts/bench_gpu.sh installs the wheels.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

# The language model's Linear layers of a Qwen3.5 (attention, Gated DeltaNet, MLP): all-linear of `sft`
LANGUAGE_LINEARS = (r"model\.language_model\.layers\.\d+\.(self_attn|linear_attn|mlp)\."
                    r"(q_proj|k_proj|v_proj|o_proj|in_proj_qkv|in_proj_z|in_proj_a|in_proj_b|out_proj|"
                    r"gate_proj|up_proj|down_proj)")


def rows(path: Path) -> list[dict]:
    """The workload's conversations as TRL's prompt-completion rows with their pictures."""
    from PIL import Image

    out = []
    for line in path.read_text().splitlines():
        user, assistant = json.loads(line)["messages"]
        picture, question = user["content"]
        image = Image.open(path.parent / picture["image_url"]["url"]).convert("RGB")
        out.append({"prompt": [{"role": "user", "content": question["text"]}],
                    "completion": [{"role": "assistant", "content": assistant["content"]}], "images": [image]})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", default="data/bench/images/train.jsonl")
    parser.add_argument("--bs", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--ac", choices=["full", "none"], default="none")
    parser.add_argument("--liger", action="store_true")
    parser.add_argument("--lora", type=int, default=16)
    args = parser.parse_args()

    from datasets import Dataset
    from peft import LoraConfig
    from transformers import (AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer, Qwen3VLProcessor,
                              TrainerCallback)
    from transformers.models.qwen3_vl import Qwen3VLVideoProcessor
    from trl import SFTConfig, SFTTrainer

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.ends: list[float] = []

        def on_step_end(self, *_, **__):
            torch.cuda.synchronize()
            self.ends.append(time.perf_counter())

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    processor = Qwen3VLProcessor(image_processor=AutoImageProcessor.from_pretrained(args.model), tokenizer=tokenizer,
                                 video_processor=Qwen3VLVideoProcessor(), chat_template=tokenizer.chat_template)
    data = Dataset.from_list(rows(Path(args.data))[: args.bs * (args.steps + 1)])
    model = AutoModelForImageTextToText.from_pretrained(args.model, dtype=torch.bfloat16, device_map="cuda")
    config = SFTConfig(
        output_dir="/tmp/trl_vlm_out", per_device_train_batch_size=args.bs, gradient_accumulation_steps=1,
        max_steps=args.steps, learning_rate=2e-4, lr_scheduler_type="constant", bf16=True, logging_steps=1,
        save_strategy="no", report_to=[], max_length=None, dataloader_num_workers=0, seed=0,
        gradient_checkpointing=args.ac == "full", use_liger_kernel=args.liger)
    lora = LoraConfig(r=args.lora, lora_alpha=2 * args.lora, lora_dropout=0.0, target_modules=LANGUAGE_LINEARS,
                      task_type="CAUSAL_LM")
    timer = StepTimes()
    real_tokens: list[int] = []
    trainer = SFTTrainer(model=model, args=config, train_dataset=data, processing_class=processor,
                         callbacks=[timer], peft_config=lora)
    collate, padded = trainer.data_collator, []

    def counted(examples):  # the tokens of each batch, as the step sees them
        batch = collate(examples)
        real_tokens.append(int(batch["attention_mask"].sum()))
        padded.append(batch["input_ids"].numel())
        return batch

    trainer.data_collator = counted
    torch.cuda.reset_peak_memory_stats()
    trainer.train()
    steady = timer.ends[args.warmup:]
    step_s = (steady[-1] - steady[0]) / (len(steady) - 1)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    per_step = len(steady) - 1
    print("RESULT " + json.dumps({
        "peer": "trl-vlm", "bs": args.bs, "ac": args.ac, "liger": args.liger, "lora": args.lora,
        "trained_parameters": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
        "step_s": step_s, "tok_s_gpu": sum(padded[args.warmup + 1: args.warmup + 1 + per_step]) / per_step / step_s,
        "nonpad_tok_s_gpu": sum(real_tokens[args.warmup + 1: args.warmup + 1 + per_step]) / per_step / step_s,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
        "loss_first": losses[:3], "loss_last": losses[-3:]}), flush=True)


if __name__ == "__main__":
    main()
