"""Memory planner: predict per-GPU peak memory and pick the sAC ratio and micro-batch that fit.

    python -m sft.plan --config configs/qwen72b.yaml --gpus 64 --gpu-mem 80

Peak = the larger of two moments, + 5% allocator slack. End of forward: fp32 params and both Adam
moments (12 bytes per parameter over the shard group; gradients are None between steps, so +4
from the second micro-batch of a step on), the gathered bf16 blocks (current + prefetched, or with
ZeRO-2 every block until its backward; the root's embeddings and lm_head), activations (a
checkpointed block keeps only its input, the others everything backward needs, plus one block
being recomputed) and the loss buffers (one chunk of fp32 logits and its gradient, the fp32
lm_head gradient formed in forward). End of backward: all 16 bytes per parameter of sharded
state, the gathered blocks, one block's unsharded fp32 gradients and one block's activations.
The activation bytes per token and layer are 2 x (10 h + 4 ffn + 4 kv) in eager mode (bf16
tensors an RMSNorm/attention/SwiGLU block saves), and 0.7 of that compiled (fusion saves fewer
intermediates), fitted on Qwen2.5-7B shapes; docs/BENCHMARKS.md "Memory planner" compares the
predictions with 18 measured peaks (0.5B-14B). Other architectures are estimates: leave a margin.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from torch import nn

from sft.config import Config, ConfigError, load_config
from sft.loss import LOGITS_PER_CHUNK
from sft.model import build_meta_model, decoder_blocks

GIB = 2**30
COMPILED_ACTIVATION_FACTOR = 0.7
ALLOCATOR_SLACK = 1.05


@dataclass(frozen=True)
class Shapes:
    params: int
    block_params: int
    root_params: int
    layers: int
    hidden: int
    ffn: int
    kv_dim: int
    vocab: int

    @classmethod
    def of(cls, model: nn.Module) -> Shapes:
        text = model.config.get_text_config()
        params = sum(p.numel() for p in model.parameters())
        block = sum(p.numel() for p in decoder_blocks(model)[0].parameters())
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        return cls(params, block, params - block * text.num_hidden_layers, text.num_hidden_layers,
                   text.hidden_size, text.intermediate_size, text.num_key_value_heads * head_dim, text.vocab_size)


def peak_bytes(s: Shapes, shard_ranks: int, tokens: int, supervised: int, ac_ratio: float, compiled: bool,
               reshard_after_forward: bool = True, grad_accum: int = 1) -> float:
    """Predicted peak allocated bytes on one GPU for `tokens` tokens per micro-batch."""
    # bf16 blocks gathered at once: the current and the prefetched one, or with
    # reshard_after_forward=False (ZeRO-2) every block from its forward to its backward.
    gathered_blocks = 2 * s.block_params if reshard_after_forward else s.layers * s.block_params
    gathered = 2 * gathered_blocks + 2 * s.root_params
    per_token_layer = 2 * (10 * s.hidden + 4 * s.ffn + 4 * s.kv_dim)
    if compiled:
        per_token_layer *= COMPILED_ACTIVATION_FACTOR
    checkpointed = round(ac_ratio * s.layers)
    activations = tokens * (checkpointed * 2 * s.hidden + (s.layers - checkpointed) * per_token_layer)
    if checkpointed:
        activations += tokens * per_token_layer  # the block being recomputed
    rows = min(supervised, max(1, LOGITS_PER_CHUNK // s.vocab))
    loss = 2 * 4 * rows * s.vocab + (4 + 2) * s.vocab * s.hidden + 2 * 2 * tokens * s.hidden
    # Two candidate peaks: the end of forward (every activation and the loss buffers alive; the
    # sharded gradients only from the second micro-batch of a step on: they are set to None after
    # each step) and the end of backward (all sharded gradients alive, one block's unsharded float32
    # gradients being reduced, activations gone).
    end_of_forward = (12 if grad_accum == 1 else 16) * s.params / shard_ranks + gathered + activations + loss
    end_of_backward = 16 * s.params / shard_ranks + gathered + 4 * s.block_params + tokens * per_token_layer
    return ALLOCATOR_SLACK * max(end_of_forward, end_of_backward)


RATIOS = (0.0, 0.25, 0.5, 0.75, 1.0)
MICRO_BATCHES = (1, 2, 4, 8)


def predict_gib(s: Shapes, cfg: Config, gpus: int, micro_batch: int, ac_ratio: float) -> float:
    """Predicted peak GiB per GPU for `cfg` with this micro-batch (of max_seq_len sequences) and
    ratio, with the grad-acc that keeps the config's global batch."""
    tokens = micro_batch * cfg.data.max_seq_len
    grad_accum = max(1, cfg.train.micro_batch_size * cfg.train.grad_accum_steps // micro_batch)
    return peak_bytes(s, gpus // cfg.fsdp.replicate_degree, tokens, tokens // 2, ac_ratio, cfg.compile.enabled,
                      cfg.fsdp.reshard_after_forward, grad_accum) / GIB


def suggest(s: Shapes, cfg: Config, gpus: int, gpu_mem_gib: float) -> tuple[float, int, int] | None:
    """(ac.ratio, micro_batch_size, grad_accum_steps) that fits and keeps the global batch: the least
    recomputation first (it costs ~8% per 0.5 of ratio on 7B), then the largest micro-batch."""
    global_batch = cfg.train.micro_batch_size * cfg.train.grad_accum_steps * gpus
    fits = [(ratio, -micro) for micro in MICRO_BATCHES for ratio in RATIOS
            if global_batch % (micro * gpus) == 0 and predict_gib(s, cfg, gpus, micro, ratio) <= gpu_mem_gib]
    if not fits:
        return None
    ratio, micro = min(fits)
    return ratio, -micro, global_batch // (-micro * gpus)


def plan(cfg: Config, gpus: int, gpu_mem_gib: float) -> str:
    s = Shapes.of(build_meta_model(cfg.model))
    lines = [f"{cfg.model.name_or_path}: {s.params / 1e9:.2f}B parameters, {s.layers} blocks, {gpus} GPUs "
             f"({gpus // cfg.fsdp.replicate_degree}-way sharding), {cfg.data.max_seq_len} tokens per sequence, "
             f"budget {gpu_mem_gib:.0f} GiB/GPU", "",
             "| micro-batch | " + " | ".join(f"ac {r:g}" for r in RATIOS) + " |", "|---" * (len(RATIOS) + 1) + "|"]
    for micro in MICRO_BATCHES:
        cells = [predict_gib(s, cfg, gpus, micro, ratio) for ratio in RATIOS]
        lines.append(f"| {micro} | " + " | ".join(f"{g:.1f}" + (" ✗" if g > gpu_mem_gib else "") for g in cells) + " |")
    current = predict_gib(s, cfg, gpus, cfg.train.micro_batch_size, cfg.ac.ratio)
    lines += ["", f"this config (micro-batch {cfg.train.micro_batch_size}, ac.ratio {cfg.ac.ratio:g}): "
                  f"{current:.1f} GiB predicted" + (" — does NOT fit" if current > gpu_mem_gib else " — fits")]
    choice = suggest(s, cfg, gpus, gpu_mem_gib)
    if choice:
        ratio, micro, accum = choice
        lines.append(f"suggested: ac.ratio={ratio:g} train.micro_batch_size={micro} "
                     f"train.grad_accum_steps={accum} (global batch {micro * accum * gpus})")
    else:
        lines.append("nothing fits: use more GPUs, fsdp.cpu_offload=true, or a shorter data.max_seq_len")
    return "\n".join(lines)


def apply_auto_plan(cfg: Config, gpus: int, gpu_mem_gib: float) -> str:
    """plan.auto: set ac.ratio / micro-batch / grad-acc in `cfg` from the planner; return a log line."""
    shapes = Shapes.of(build_meta_model(cfg.model))
    choice = suggest(shapes, cfg, gpus, gpu_mem_gib)
    if choice is None:
        raise ConfigError(f"plan.auto: nothing fits {gpu_mem_gib:.0f} GiB per GPU on {gpus} GPUs; use more GPUs, "
                          "fsdp.cpu_offload=true or a shorter data.max_seq_len")
    cfg.ac.ratio, cfg.train.micro_batch_size, cfg.train.grad_accum_steps = choice
    return (f"plan.auto: ac.ratio={cfg.ac.ratio:g} train.micro_batch_size={cfg.train.micro_batch_size} "
            f"train.grad_accum_steps={cfg.train.grad_accum_steps} "
            f"(predicted {predict_gib(shapes, cfg, gpus, cfg.train.micro_batch_size, cfg.ac.ratio):.1f} GiB per GPU)")


def check_fits(model: nn.Module, cfg: Config, world_size: int, gpu_mem_gib: float) -> str | None:
    """A warning if the planner predicts this run exceeds the GPU's memory, else None."""
    predicted = predict_gib(Shapes.of(model), cfg, world_size, cfg.train.micro_batch_size, cfg.ac.ratio)
    if predicted <= gpu_mem_gib:
        return None
    return (f"warning: the memory planner predicts {predicted:.0f} GiB per GPU for {gpu_mem_gib:.0f} GiB GPUs; "
            f"see `python -m sft.plan --config <this config> --gpus {world_size} --gpu-mem {gpu_mem_gib:.0f}`")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--gpus", type=int, required=True, help="total number of GPUs")
    parser.add_argument("--gpu-mem", type=float, default=80, help="GiB per GPU you allow the run to use")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    print(plan(load_config(args.config, args.overrides), args.gpus, args.gpu_mem))


if __name__ == "__main__":
    main()
