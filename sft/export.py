"""Export a training checkpoint as a Hugging Face model directory (safetensors + config + tokenizer),
or, for a LoRA run, as a PEFT adapter.

    python -m sft.export runs/my-run/checkpoints/step-1000 runs/my-run/export [--dtype bfloat16]
    python -m sft.export runs/my-lora-run/checkpoints/step-1000 out [--merge]

The model loads with `AutoModelForCausalLM.from_pretrained` (and so vLLM). A LoRA checkpoint
exports its adapter in PEFT's format (adapter_config.json naming the base it was trained on, and
adapter_model.safetensors), which `peft.PeftModel.from_pretrained(base, out)` loads; with --merge,
the base with the adapter folded into its weights (W + alpha / r * B A), a plain Hugging Face model.
Runs in one process on the CPU and never needs the whole model in memory: tensors are read from
the sharded DCP checkpoint (and a LoRA run's base from its own files) a group at a time (up to one
output shard, 5 GiB) and written as they come.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open

from sft import atomic
from sft.adapters.peft_format import merged, write_adapter
from sft.checkpoint.layout import (CONFIG, HF_FILES, TRAIN_STATE, CheckpointError, checkpoint_problem, content_problem,
                                   read_train_state)
from sft.checkpoint.reader import read_checkpoint
from sft.config import DTYPES, Config, LoRAConfig, ModelConfig, is_local_path, read_resolved_config
from sft.errors import UserError, run_command
from sft.hub.identity import base_changed, base_identity
from sft.hub.layout import MAX_SHARD_BYTES, to_hub_tensors, write_safetensors
from sft.hub.tokenizer import load_tokenizer
from sft.hub.vision_language import KEPT, FileNames, checkpoint_class, copy_processor_files
from sft.hub.weights import initial_weights
from sft.models.architecture import text_config
from sft.models.build import build_meta_model, persistent_buffers


def _tensors(checkpoint: Path, shapes: dict[str, torch.Size]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's model tensors named in `shapes`, float32, read a group at a time."""
    names = list(shapes)
    while names:
        group, size = {}, 0
        while names and (not group or size + shapes[names[0]].numel() * 4 <= MAX_SHARD_BYTES):
            name = names.pop(0)
            group[name] = torch.empty(shapes[name], dtype=torch.float32)
            size += group[name].numel() * 4
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            read_checkpoint({"model": group}, checkpoint, no_dist=True)
        yield from group.items()


def export_hf(checkpoint: Path, out_dir: Path, dtype: str = "bfloat16", merge: bool = False,
              allow_base_change: bool = False) -> str:
    """Write `out_dir` (atomically) from the committed checkpoint directory `checkpoint`: the model,
    or a LoRA run's adapter (`merge`: the model with the adapter merged in); return which, for the log.
    A LoRA run's base whose weights changed since training is refused unless `allow_base_change`."""
    # The checkpoint carries the model's config.json and tokenizer (hf/): the original model
    # directory or hub cache need not exist any more (but for a LoRA run's base weights).
    cfg = read_resolved_config(checkpoint / CONFIG)
    model_cfg = ModelConfig(name_or_path=str(checkpoint / HF_FILES), trust_remote_code=cfg.model.trust_remote_code)
    model = build_meta_model(model_cfg)
    # Parameters, each once (a tied lm_head is the embedding and is re-tied on load), and the buffers
    # a checkpoint holds (DeepSeek-V3's router correction bias).
    shapes = {name: p.shape for name, p in model.named_parameters()}
    shapes.update({name: b.shape for name, b in persistent_buffers(model).items()})
    # A LoRA run's base as its checkpoint records it: a local one by its absolute path, as training
    # found it (the export may run elsewhere); a checkpoint from before the record: the config's.
    record = read_train_state(checkpoint / TRAIN_STATE).get("lora", {})
    base = record.get("base", cfg.model.name_or_path)
    base = str(Path(base).resolve()) if is_local_path(base) else base
    if cfg.lora.enabled and (merge or Path(base).is_dir()):  # the adapter alone needs no base, but names it
        _check_base(checkpoint, record.get("weights", ""), base, cfg, model, allow_base_change)
    try:
        with atomic.directory(out_dir) as tmp:
            if cfg.lora.enabled and not merge:
                _write_adapter(checkpoint, cfg.lora, base, record.get("weights", ""), model, tmp, DTYPES[dtype])
            else:
                tensors = _merged(checkpoint, cfg, base, model, shapes) if cfg.lora.enabled \
                    else _tensors(checkpoint, shapes)
                write_model(tensors, model, checkpoint / HF_FILES, tmp, dtype)
            load_tokenizer(model_cfg).save_pretrained(tmp)
            copy_processor_files(checkpoint / HF_FILES, tmp)  # a vision-language checkpoint's image processor
    except atomic.PathInTheWay as e:
        raise UserError(f"cannot export to {out_dir}: {e}; give a new directory (an export never writes into or "
                        "over an existing one)") from None
    return "the LoRA adapter" if cfg.lora.enabled and not merge else "a Hugging Face model"


def write_model(tensors: Iterable[tuple[str, torch.Tensor]], model, model_files: Path, out: Path,
                dtype: str) -> None:
    """Write the model whose (name, tensor) pairs are `tensors` into `out` as a Hugging Face model in
    `dtype`: as save_pretrained writes it (experts one tensor each, renamed, ...: sft/hub/layout.py),
    with the config of `model_files` (a checkpoint's hf/); a vision-language checkpoint's as the
    original, its language model as trained and the kept tensors (vision tower...) as they were."""
    kept_dtype = _kept_in_their_dtype(model)
    trained = to_hub_tensors(model, ((n, t if n in kept_dtype else t.to(DTYPES[dtype])) for n, t in tensors),
                             checkpoint_class(model_files))
    kept = model_files / KEPT
    if kept.is_file():  # a vision-language checkpoint: the original, its language model trained
        write_safetensors(_with_kept(trained, kept), out)
        (out / "config.json").write_text(_original_config(model_files / "config.json", dtype))
    else:
        write_safetensors(trained, out)
        model.config.dtype = dtype
        model.config.use_cache = True  # for inference
        model.config.save_pretrained(out)


def _kept_in_their_dtype(model) -> set[str]:
    """Tensors the export writes in float32 whatever --dtype says: the buffers a checkpoint holds
    (DeepSeek-V3's correction bias: a bf16 copy would lose its updates) and what the architecture
    keeps in float32 (`_keep_in_fp32_modules(_strict)`: DeepSeek-V3's and GLM-4.5's routers)."""
    buffers = set(persistent_buffers(model))
    fp32 = [*(getattr(model, "_keep_in_fp32_modules", None) or []), *(getattr(model, "_keep_in_fp32_modules_strict",
                                                                             None) or [])]
    return buffers | {name for name, _ in model.named_parameters() if any(f".{part}" in f".{name}" for part in fp32)}


def _original_config(original: Path, dtype: str) -> str:
    """A vision-language checkpoint's config.json as it was, but for the dtype it names (at the top and
    in its text_config): the language model's as exported, which transformers loads the model in."""
    text = original.read_text()
    config = json.loads(text)
    named = [(section, key) for section in (config, config.get("text_config") or {})
             for key in ("dtype", "torch_dtype") if key in section]
    if all(section[key] == dtype for section, key in named):
        return text
    for section, key in named:
        section[key] = dtype
    return json.dumps(config, indent=2) + "\n"


def _with_kept(trained: Iterator[tuple[str, torch.Tensor]], kept: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """A vision-language checkpoint's tensors as its files name them: the trained language model's
    under the files' names, then the kept ones (vision tower...) as the files held them, one at a time."""
    with safe_open(kept, framework="pt") as f:
        names = FileNames.from_metadata(f.metadata())
        yield from ((names.of(name), tensor) for name, tensor in trained)
        yield from ((name, f.get_tensor(name)) for name in f.keys())


def _trained_shapes(checkpoint: Path) -> dict[str, torch.Size]:
    """The parameters a LoRA checkpoint holds (adapters, modules trained in full), by model name."""
    metadata = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    return {key.removeprefix("model."): metadata[key].size for key in metadata if key.startswith("model.")}


def _check_base(checkpoint: Path, recorded: str, base: str, cfg: Config, model, allowed: bool) -> None:
    """Refuse (UserError) a base whose weights are not those the LoRA checkpoint's adapters were
    trained on (as it `recorded`), unless `allowed`."""
    current = base_identity(dataclasses.replace(cfg.model, name_or_path=base), cfg.train.seed, model)["weights"]
    if not base_changed(recorded, current):
        return
    if not allowed:
        raise UserError(f"{checkpoint}'s adapters were trained on other weights than {base} holds now ({recorded} -> "
                        f"{current}): export with the base they were trained on, or pass --allow-base-change to "
                        "use this one anyway")
    print(f"warning: {base} is not the base {checkpoint}'s adapters were trained on (--allow-base-change)")


def _write_adapter(checkpoint: Path, lora: LoRAConfig, base: str, base_weights: str, model, out: Path,
                   dtype: torch.dtype) -> None:
    """A LoRA checkpoint's adapter in PEFT's format, for `model` (the meta-device model it was
    trained on, based on `base`, whose weights' fingerprint is `base_weights`)."""
    trained = {name: tensor.to(dtype) for name, tensor in _tensors(checkpoint, _trained_shapes(checkpoint))}
    # A trained embedding of a tied model is its lm_head too: PEFT unties them unless asked to keep
    # them tied (ensure_weight_tying), and then reads both.
    names = {module: name for name, module in model.named_modules()}
    embedding, head = names[model.get_input_embeddings()], names[model.get_output_embeddings()]
    tied = text_config(model.config).tie_word_embeddings and f"{embedding}.weight" in trained
    if tied:
        trained[f"{head}.weight"] = trained[f"{embedding}.weight"].clone()
    write_adapter(out, trained, lora, base, base_weights, tied, model)


def _merged(checkpoint: Path, cfg: Config, base: str, model, shapes: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """The base's tensors (from its own files at `base`, or its random init) with the adapters merged
    in and the modules trained in full as trained: float32, one tensor at a time."""
    trained = dict(_tensors(checkpoint, _trained_shapes(checkpoint)))
    base_cfg = ModelConfig(name_or_path=base, init=cfg.model.init, trust_remote_code=cfg.model.trust_remote_code)
    weights = initial_weights(base_cfg, cfg.train.seed, model)
    built = persistent_buffers(model)  # a buffer the base's files lack keeps the architecture's init
    with weights.reading():  # each of the base's files opened once
        for name in shapes:
            weight = trained.get(name)
            if weight is None:
                weight = weights.read(name, (), torch.device("cpu")).float() if weights.holds(name) else built[name]
            yield name, merged(name, weight, trained, cfg.lora.scaling, model)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="a committed checkpoints/step-N directory")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--merge", action="store_true",
                        help="a LoRA checkpoint: write the base with the adapter merged in, not the adapter")
    parser.add_argument("--allow-base-change", action="store_true",
                        help="a LoRA checkpoint: export even if its base's weights changed since training")
    args = parser.parse_args(argv)
    problem = checkpoint_problem(args.checkpoint) or content_problem(args.checkpoint)
    if problem:
        raise CheckpointError(f"{args.checkpoint} is not a usable checkpoint ({problem}): give a committed "
                              "checkpoints/step-N directory (its run's checkpoints/latest names the newest)")
    export_hf(args.checkpoint, args.out_dir, args.dtype, args.merge, args.allow_base_change)
    print(f"exported {args.checkpoint} to {args.out_dir}")


if __name__ == "__main__":
    run_command(main)
