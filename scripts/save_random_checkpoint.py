"""Save a randomly initialised model as a Hugging Face checkpoint (bf16 or float32 safetensors, with
its tokenizer when the directory has one), one module at a time, so large shapes (7B, 32B) can be
written without holding the model in memory (a vision-language model is built whole on --device).

    python scripts/save_random_checkpoint.py configs/models/qwen2.5-7b /tmp/qwen7b-random --device cuda

Used by the benchmarks to exercise the real loading path without downloading weights, by
`make demo-lora` for the frozen base its adapters train on and by `make demo-vlm`. A vision-language
config is written whole, as transformers saves its class (language model, vision tower, projector),
with the image processor's files.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from transformers import AutoModelForImageTextToText

from sft import atomic
from sft.config import ModelConfig
from sft.hub.layout import write_safetensors
from sft.hub.weights import RandomWeights
from sft.models.build import model_config
from sft.models.vision_language import is_vision_language


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", help="directory with config.json (and optionally tokenizer files)")
    parser.add_argument("out_dir")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = parser.parse_args()
    cfg = ModelConfig(name_or_path=args.model_dir, init="random")
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    with atomic.directory(Path(args.out_dir)) as tmp:
        if is_vision_language(config := model_config(cfg)):
            torch.manual_seed(args.seed)
            with device:
                AutoModelForImageTextToText.from_config(config, dtype=dtype).save_pretrained(tmp)
        else:
            weights = RandomWeights(cfg, args.seed)
            write_safetensors(((name, weights.read(name, (), device).to(dtype))
                               for name, _ in weights.reference.named_parameters()), tmp)
        for extra in Path(args.model_dir).iterdir():
            if extra.suffix in (".json", ".jinja") and not extra.name.startswith("model.safetensors"):
                shutil.copy(extra, tmp / extra.name)
    print(f"wrote {args.out_dir}")


if __name__ == "__main__":
    main()
