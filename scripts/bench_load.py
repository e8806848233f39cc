"""Time loading a checkpoint as transformers saves it (one tensor per expert) through our loader,
next to transformers' `from_pretrained` of the same files, on this machine's CPU.

    python scripts/bench_load.py /tmp/qwen3moe-8x128   # writes the checkpoint there first if missing

The default shapes are the [startup] issue's CPU case: Qwen3-MoE, 8 blocks of 128 experts, 0.4 GB
in bf16 (3,072 expert tensors); the page cache is warmed by a first read of every file.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from sft.config import ModelConfig
from sft.models.build import build_meta_model, materialize, real_buffers
from sft.models.weights import SafetensorsWeights, load_weights


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", type=Path)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if not (args.directory / "config.json").is_file():
        config = AutoConfig.for_model("qwen3_moe", hidden_size=512, intermediate_size=1024, moe_intermediate_size=128,
                                      num_experts=128, num_experts_per_tok=8, num_hidden_layers=8,
                                      num_attention_heads=8, num_key_value_heads=4, head_dim=64, vocab_size=32000,
                                      dtype="bfloat16")
        AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(args.directory)
    for file in args.directory.glob("*.safetensors"):  # warm the page cache for both sides
        file.read_bytes()
    for _ in range(args.repeats):
        model = build_meta_model(ModelConfig(name_or_path=str(args.directory)))
        materialize(model, real_buffers(model), torch.device("cpu"))
        t0 = time.perf_counter()
        weights = SafetensorsWeights(str(args.directory), model)
        weights.check()
        load_weights(model, weights, torch.device("cpu"))
        ours = time.perf_counter() - t0
        t0 = time.perf_counter()
        AutoModelForCausalLM.from_pretrained(args.directory)
        theirs = time.perf_counter() - t0
        print(f"ours {ours:.2f} s (check and load), from_pretrained {theirs:.2f} s", flush=True)


if __name__ == "__main__":
    main()
