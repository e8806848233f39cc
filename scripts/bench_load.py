"""Time loading a checkpoint as transformers saves it (one tensor per expert) through our loader,
next to transformers' `from_pretrained` of the same files, on this machine's CPU or GPU.

    python scripts/bench_load.py /tmp/qwen3moe-8x128                 # writes the checkpoint there first if missing
    python scripts/bench_load.py /tmp/qwen35moe-12 --preset qwen3.5-35b-a3b-12 --device cuda

The presets are the [startup] issue's cases: `cpu` Qwen3-MoE, 8 blocks of 128 experts, 0.4 GB in
bf16 (3,072 expert tensors); `qwen3.5-35b-a3b-12` Qwen3.5-35B-A3B's widths, 12 of its 40 blocks,
22.2 GB (9,216 expert tensors); `qwen3-30b-a3b-24` Qwen3-30B-A3B with 24 of its 48 blocks, 30.5 GB.
Both sides load bf16 onto `--device`; the page cache is warmed by a first read of every file. Each
repeat checks that each of our loads (one per --threads) loaded what transformers loads, bit for bit.

--dcp DIR: then the same weights saved once as a torch.distributed.checkpoint (what a resume reads,
here in bf16: the same bytes as the files) and read back into the model as a resume does
(`read_checkpoint`, `set_model_state_dict`), next to torch's own reader (`dcp.load`), timed each repeat
and checked bit for bit.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from transformers import AutoConfig, AutoModelForCausalLM

from sft.checkpoint.reader import read_checkpoint
from sft.config import ModelConfig
from sft.models.build import build_meta_model, materialize, real_buffers
from sft.hub import weights as weights_module
from sft.hub.weights import SafetensorsWeights, load_weights


PRESETS = {
    "cpu": ("qwen3_moe", dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=128, num_experts=128,
                              num_experts_per_tok=8, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                              head_dim=64, vocab_size=32000)),
    "qwen3.5-35b-a3b-12": ("qwen3_5_moe_text", dict(num_hidden_layers=12)),  # its config class's defaults: 35B-A3B
    # Qwen3-30B-A3B's config.json with 24 of its 48 blocks: 30.5 GB, 9,216 expert tensors
    "qwen3-30b-a3b-24": ("qwen3_moe", {**{k: v for k, v in json.loads(
        (Path(__file__).parents[1] / "configs/models/qwen3-30b-a3b/config.json").read_text()).items()
        if k not in ("model_type", "architectures", "torch_dtype")}, "num_hidden_layers": 24, "max_window_layers": 24}),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", type=Path)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, nargs="+", default=[weights_module.READ_THREADS],
                        help="our loader's reading threads (sft/hub/weights.py: READ_THREADS), each timed")
    parser.add_argument("--dcp", type=Path, help="also time a DCP resume of the same weights (saved there once)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if not (args.directory / "config.json").is_file():
        model_type, shapes = PRESETS[args.preset]
        with device:
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **shapes, dtype="bfloat16"),
                                                     dtype=torch.bfloat16)
        model.save_pretrained(args.directory)
        del model
    for file in args.directory.glob("*.safetensors"):  # warm the page cache for both sides
        file.read_bytes()
    size = sum(file.stat().st_size for file in args.directory.glob("*.safetensors"))
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(args.repeats):
        ours, loaded = {}, None
        for threads in args.threads:
            weights_module.READ_THREADS = threads
            model = build_meta_model(ModelConfig(name_or_path=str(args.directory))).to(torch.bfloat16)
            materialize(model, real_buffers(model), device)
            t0 = time.perf_counter()
            weights = SafetensorsWeights(str(args.directory), model)
            weights.check()
            checked = time.perf_counter() - t0
            load_weights(model, weights, device)
            synchronize()
            ours[threads] = time.perf_counter() - t0, checked
            # each load the same as the one before it, bit for bit (the last: as transformers', below)
            if loaded is not None:
                assert all(torch.equal(loaded[name], tensor) for name, tensor in model.state_dict().items())
            loaded = model.state_dict()
            del model, weights
        t0 = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(args.directory, dtype=torch.bfloat16, device_map=args.device)
        synchronize()
        theirs = time.perf_counter() - t0
        # the same weights, bit for bit
        differ = [name for name, tensor in model.state_dict().items() if not torch.equal(loaded[name], tensor)]
        assert not differ, f"{len(differ)} tensors differ from transformers', e.g. {differ[0]}"
        del model, loaded
        print(f"{size / 1e9:.1f} GB on {args.device}: ours " + ", ".join(
            f"{t:.2f} s with {n} threads ({size / 1e9 / t:.2f} GB/s; the check {c:.2f} s)"
            for n, (t, c) in ours.items())
            + f" (check and load); from_pretrained {theirs:.2f} s ({size / 1e9 / theirs:.2f} GB/s)", flush=True)
    if args.dcp is not None:
        time_dcp_resume(args, device, size, synchronize)


def time_dcp_resume(args: argparse.Namespace, device: torch.device, size: int, synchronize) -> None:
    """The weights loaded from the files, saved once as a DCP checkpoint, read back as a resume does."""
    model = build_meta_model(ModelConfig(name_or_path=str(args.directory))).to(torch.bfloat16)
    materialize(model, real_buffers(model), device)
    load_weights(model, SafetensorsWeights(str(args.directory), model), device)
    expected = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    if not (args.dcp / ".metadata").is_file():
        t0 = time.perf_counter()
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=args.dcp, no_dist=True)
        print(f"DCP save of the same weights: {time.perf_counter() - t0:.2f} s", flush=True)
    for file in args.dcp.iterdir():  # warm the page cache, as for the files above (a chunk at a time: one file)
        with file.open("rb") as stream:
            while stream.read(1 << 28):
                pass
    readers = {"our reader (read_checkpoint)": lambda state: read_checkpoint(state, args.dcp, no_dist=True),
               "torch's reader (dcp.load)": lambda state: dcp.load(state, checkpoint_id=args.dcp, no_dist=True)}
    for _ in range(args.repeats):
        for reader, read in readers.items():
            with torch.no_grad():
                for tensor in model.state_dict().values():
                    tensor.zero_()
            t0 = time.perf_counter()
            state = {"model": get_model_state_dict(model)}
            read(state)
            set_model_state_dict(model, state["model"])
            synchronize()
            took = time.perf_counter() - t0
            assert all(torch.equal(expected[name], tensor) for name, tensor in model.state_dict().items())
            print(f"{size / 1e9:.1f} GB on {args.device}: DCP resume, {reader}, {took:.2f} s "
                  f"({size / 1e9 / took:.2f} GB/s)", flush=True)


if __name__ == "__main__":
    main()
