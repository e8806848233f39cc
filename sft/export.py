"""Export a training checkpoint as a Hugging Face model directory (safetensors + config + tokenizer).

    python -m sft.export runs/my-run/checkpoints/step-1000 runs/my-run/export [--dtype bfloat16]

The result loads with `AutoModelForCausalLM.from_pretrained` (and so vLLM). Runs in one process
on the CPU and never needs the whole model in memory: tensors are read from the sharded DCP
checkpoint a group at a time (up to one output shard, 5 GiB) and written as they come.
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import yaml

from sft import atomic
from sft.checkpoint.layout import CheckpointError, checkpoint_problem, content_problem
from sft.config import DTYPES, ModelConfig
from sft.errors import run_command
from sft.models.hub import MAX_SHARD_BYTES, write_safetensors
from sft.models.build import build_meta_model, load_tokenizer
from sft.models.hub import to_hub_tensors


def _tensors(checkpoint: Path, shapes: dict[str, torch.Size], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    names = list(shapes)
    while names:
        group, size = {}, 0
        while names and (not group or size + shapes[names[0]].numel() * 4 <= MAX_SHARD_BYTES):
            name = names.pop(0)
            group[name] = torch.empty(shapes[name], dtype=torch.float32)
            size += group[name].numel() * 4
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({"model": group}, checkpoint_id=checkpoint, no_dist=True)
        for name, tensor in group.items():
            yield name, tensor.to(dtype)


def export_hf(checkpoint: Path, out_dir: Path, dtype: str = "bfloat16") -> None:
    """Write `out_dir` (atomically) from the committed checkpoint directory `checkpoint`."""
    # The checkpoint carries the model's config.json and tokenizer (hf/): the original model
    # directory or hub cache need not exist any more.
    trust_remote_code = yaml.safe_load((checkpoint / "config.yaml").read_text())["model"]["trust_remote_code"]
    model_cfg = ModelConfig(name_or_path=str(checkpoint / "hf"), trust_remote_code=trust_remote_code)
    model = build_meta_model(model_cfg)
    # Parameters only, each once: a tied lm_head is the embedding and is re-tied on load.
    shapes = {name: p.shape for name, p in model.named_parameters()}
    with atomic.directory(out_dir) as tmp:
        # MoE: fused expert tensors are written per expert, as transformers saves them (sft/moe.py).
        write_safetensors(to_hub_tensors(model.config.model_type, _tensors(checkpoint, shapes, DTYPES[dtype])), tmp)
        model.config.dtype = dtype
        model.config.use_cache = True  # for inference
        model.config.save_pretrained(tmp)
        load_tokenizer(model_cfg).save_pretrained(tmp)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="a committed checkpoints/step-N directory")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    args = parser.parse_args(argv)
    problem = checkpoint_problem(args.checkpoint) or content_problem(args.checkpoint)
    if problem:
        raise CheckpointError(f"{args.checkpoint} is not a usable checkpoint ({problem}): give a committed "
                              "checkpoints/step-N directory (its run's checkpoints/latest names the newest)")
    export_hf(args.checkpoint, args.out_dir, args.dtype)
    print(f"exported {args.checkpoint} to {args.out_dir}")


if __name__ == "__main__":
    run_command(main)
