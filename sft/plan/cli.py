"""`python -m sft.plan`: the planner's table of settings for a config and a number of GPUs, what
fits, and what plan.auto would choose (the memory model: sft/plan/memory.py)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from torch import nn

from sft.config import Config, ModelConfig, load_config
from sft.config import state_bytes
from sft.models.build import ModelError, build_meta_model
from sft.parallel.mesh import ParallelDims
from sft.plan import memory
from sft.plan.host import host_gib_per_node, offloaded_block_bytes_per_rank
from sft.plan.memory import (DEFAULT_GPUS_PER_NODE, GIB, ROUTED_USABLE_FRACTION, USABLE_FRACTION, Machine, Shapes,
                             gpus_text, predict_fit, predict_gib)
from sft.plan.search import (AC_SETTINGS, MICRO_BATCHES, ac_label, as_overrides, host_refusal, nothing_fits,
                             long_row_choice, roomier_layout, smallest_cp, suggest, text_of)

# Shapes (config.json only) of the models the configs name, for planning where the hub is not reachable.
SHIPPED_SHAPES = Path(__file__).resolve().parents[2] / "configs" / "models"

def planning_model(cfg: ModelConfig) -> tuple[nn.Module, str]:
    """The meta model to plan for, and a note. A hub model this machine cannot fetch (a login node
    without network) is planned from its shapes in configs/models, when they are shipped."""
    try:
        return build_meta_model(cfg), ""
    except ModelError:
        shipped = SHIPPED_SHAPES / cfg.name_or_path.split("/")[-1].lower().removesuffix("-instruct")
        if "/" not in cfg.name_or_path or not (shipped / "config.json").is_file():
            raise
        note = f" (the hub is not reachable: shapes from {shipped})"
        return build_meta_model(dataclasses.replace(cfg, name_or_path=str(shipped))), note


def plan(cfg: Config, m: Machine, host_mem_note: str = "") -> tuple[str, bool]:
    """The planner's report, and whether any setting fits (GPU and, with offload, host)."""
    model, shapes_note = planning_model(cfg.model)
    s = Shapes.of(model, cfg.lora)
    active = f" ({s.active_params / 1e9:.2f}B active: {s.top_k} of {s.experts} experts per token)" if s.experts else ""
    lines = [f"{cfg.model.name_or_path}{shapes_note}: {s.params / 1e9:.2f}B parameters{active}, {s.layers} blocks, "
             f"{gpus_text(m.gpus)} "
             f"({ParallelDims.of(cfg, m.gpus).shard_ranks}-way sharding), {cfg.data.max_seq_len} tokens per sequence"
             + (f" split over cp.degree={cfg.cp.degree} GPUs" if cfg.cp.degree > 1 else "") + ", "
             f"budget {m.gpu_mem_gib:.0f} GiB/GPU, of which {USABLE_FRACTION:.0%} for the peak"
             + (f" ({ROUTED_USABLE_FRACTION:.0%} under expert parallelism where routed rows are kept across blocks)"
                if s.experts else "")
             + (", fsdp.cpu_offload: no sharded state on the GPUs" if cfg.fsdp.cpu_offload else "")
             + (f", moe.ep_degree={cfg.moe.ep_degree}" if cfg.moe.ep_degree > 1 else "")
             + f", {state_bytes(cfg.optim).total} bytes of state per trained parameter", "",
             "| micro-batch | " + " | ".join(ac_label(*setting) for setting in AC_SETTINGS) + " |",
             "|---" * (len(AC_SETTINGS) + 1) + "|"]
    for micro in MICRO_BATCHES:
        cells = [predict_fit(s, cfg, m, micro, ratio, mode) for ratio, mode in AC_SETTINGS]
        lines.append(f"| {micro} | " + " | ".join(f"{g:.1f}" + ("" if ok else " ✗") for g, ok in cells) + " |")
    current, fits = predict_fit(s, cfg, m, cfg.train.micro_batch_size, cfg.ac.ratio, cfg.ac.mode)
    mode = f", ac.mode {cfg.ac.mode}" if cfg.ac.mode != "blocks" else ""
    lines += ["", f"this config (micro-batch {cfg.train.micro_batch_size}, ac.ratio {cfg.ac.ratio:g}{mode}): "
                  f"{current:.1f} GiB per GPU predicted" + (" — fits" if fits else " — does NOT fit")]
    if cfg.checkpoint.enabled:
        each, at_once = state_bytes(cfg.optim).checkpoint * s.trained / GIB, cfg.checkpoint.most_on_disk
        lines.append(f"checkpoints: {each:.1f} GiB each (weights and Adam moments), up to {at_once} at once "
                     f"(checkpoint.keep_last + the one being written): {each * at_once:.1f} GiB of train.output_dir")
    if cfg.fsdp.cpu_offload or cfg.ac.offload:
        need = host_gib_per_node(s, cfg, m)
        parts = ["fp32 params + grads pinned, Adam moments"] if cfg.fsdp.cpu_offload else []
        parts += ["the checkpoint staging"] if cfg.fsdp.cpu_offload and cfg.checkpoint.stages_in_host_memory else []
        if cfg.ac.offload:
            offloaded = offloaded_block_bytes_per_rank(s, cfg, m) / GIB
            parts.append(f"{offloaded:.1f} GiB of the checkpointed blocks' inputs (ac.offload)")
        lines.append(f"host: {need:.1f} GiB per node predicted ({gpus_text(m.gpus_on_a_node)} per node x "
                     f"{need / m.gpus_on_a_node:.1f} GiB: {', '.join(parts)}, the process) for "
                     f"{m.host_mem_gib:.0f} GiB{host_mem_note}"
                     + (" — does NOT fit" if need > m.host_mem_gib else " — fits"))
    choice = suggest(s, cfg, m)
    if choice:
        _, _, micro, accum = choice
        global_batch = ParallelDims.of(cfg, m.gpus).global_batch(micro, accum)
        lines.append(f"suggested: {as_overrides(*choice)} (global batch {global_batch})")
    elif long_rows := long_row_choice(s, cfg, m):
        long_cfg, setting, overrides = long_rows
        ratio, mode, micro, _ = setting
        host = (f" and {host_gib_per_node(s, long_cfg, m, micro, ratio):.1f} GiB of host memory per node"
                if long_cfg.ac.offload else "")
        lines.append(f"it fits with: {text_of(overrides)} {as_overrides(*setting)} "
                     f"({predict_gib(s, long_cfg, m.gpus, micro, ratio, mode):.1f} GiB per GPU{host} "
                     "predicted; plan.auto chooses it)")
    else:
        host = host_refusal(s, cfg, m)
        lines.append(host or nothing_fits(s, cfg, m))
        # lighter state helps the GPUs only, not a host that cannot hold what is offloaded
        if not host and (roomier := roomier_layout(s, cfg, m)):
            roomier_cfg, roomier_choice, overrides = roomier
            state = f"{state_bytes(roomier_cfg.optim).total} bytes of state per parameter"
            lean = any(key.startswith("optim.") for key in overrides)
            overrides = text_of(overrides)
            if roomier_choice is None:
                least = min(predict_gib(s, roomier_cfg, m.gpus, micro, ratio, mode)
                            for micro in MICRO_BATCHES for ratio, mode in AC_SETTINGS)
                lines.append(f"nor with {overrides} ({state}): the least any setting needs is {least:.1f} GiB per GPU")
            else:
                ratio, mode, micro, _ = roomier_choice
                predicted = predict_gib(s, roomier_cfg, m.gpus, micro, ratio, mode)
                lines.append(f"it fits with: {overrides} {as_overrides(*roomier_choice)} ({predicted:.1f} GiB per GPU "
                             f"predicted, {state}; plan.auto chooses it"
                             + (" with plan.allow_lean_state=true)" if lean else ")"))
    degree = smallest_cp(s, cfg, m)
    if degree is not None and degree != cfg.cp.degree:
        lines.append(f"context parallelism: cp.degree={degree} is the smallest at which a row of "
                     f"{cfg.data.max_seq_len} tokens fits (python -m sft.plan ... cp.degree={degree} for its table)")
    return "\n".join(lines), choice is not None


def main(argv: list[str] | None = None) -> int:
    """Print the plan; exit status 1 when nothing fits, so a script can stop before queueing."""
    parser = argparse.ArgumentParser(description=f"{__doc__}\n{memory.__doc__}",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--gpus", type=int, required=True, help="total number of GPUs")
    parser.add_argument("--gpu-mem", type=float, default=80, help="GiB per GPU you allow the run to use")
    parser.add_argument("--host-mem", type=float, default=None,
                        help="with fsdp.cpu_offload or ac.offload: host GiB per node you allow the run to use "
                             "(default: this machine's memory, right only if it is one of the job's nodes)")
    parser.add_argument("--gpus-per-node", type=int, default=None,
                        help=f"with fsdp.cpu_offload or ac.offload: GPUs per node (default: min(--gpus, "
                             f"{DEFAULT_GPUS_PER_NODE}))")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args(argv)  # overrides may come before and after the options
    m = Machine.of(args.gpus, args.gpu_mem, args.host_mem, args.gpus_per_node)
    note = "" if args.host_mem else " (this machine's memory: pass --host-mem for the compute nodes')"
    report, fits = plan(load_config(args.config, args.overrides, local_checks=False), m, note)
    print(report)
    return 0 if fits else 1

