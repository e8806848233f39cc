"""The search over layouts: the least recomputation (ac.ratio, ac.mode) and the micro-batch that fit,
a cp.degree where rows do not fit, a roomier layout (expert parallelism, lean state) where nothing
does; plan.auto applies the choice to the config, and train.py warns when a run may not fit."""

from __future__ import annotations

import copy
import dataclasses
import math

import torch

from sft.config import Config, ConfigError
from sft.config.checks import range_checks
from sft.errors import UserError, explain
from sft.models.build import build_meta_model
from sft.parallel.activation_checkpointing import AC_MODES, ac_block_indices, recompute_fraction
from sft.parallel.mesh import ParallelDims
from sft.plan.host import host_gib_per_node, host_problem
from sft.plan.memory import GIB, Machine, Shapes, gpus_text, predict_fit, predict_gib, usable_fraction

RATIOS = (0.0, 0.25, 0.5, 0.75, 1.0)
MODES = tuple(AC_MODES)
# (ac.ratio, ac.mode) settings the planner tabulates and plan.auto chooses from; ratio 0 has no mode.
AC_SETTINGS = tuple((ratio, mode) for ratio in RATIOS for mode in MODES if ratio > 0 or mode == "blocks")
MICRO_BATCHES = (1, 2, 4, 8)


def recompute_cost(s: Shapes, seq_len: int, ac_ratio: float, ac_mode: str) -> float:
    """Recomputed work per step in whole-block forwards: what plan.auto minimises."""
    return len(ac_block_indices(s.layers, ac_ratio)) * recompute_fraction(s, seq_len, ac_mode)


def as_overrides(ratio: float, mode: str, micro_batch: int, grad_accum: int) -> str:
    """A setting (as `suggest` returns it) as the command-line overrides that select it."""
    return (f"ac.ratio={ratio:g} ac.mode={mode} train.micro_batch_size={micro_batch} "
            f"train.grad_accum_steps={grad_accum}")


def ac_label(ac_ratio: float, ac_mode: str) -> str:
    return f"ac {ac_ratio:g}" + (f" {ac_mode}" if ac_mode != "blocks" else "")


def suggest(s: Shapes, cfg: Config, m: Machine, failed: tuple[float, str, int] | None = None
            ) -> tuple[float, str, int, int] | None:
    """(ac.ratio, ac.mode, micro_batch_size, grad_accum_steps) that fits and keeps the global batch:
    settings at the configured micro-batch or a larger one first (a smaller one adds grad-acc
    steps, each with its own all-gathers and reduce-scatters, which recomputation does not weigh),
    then the least recomputation (recompute_cost; on 2 x H100, P-7B bf16, each whole block rerun
    cost 0.55% of a step), then the largest micro-batch (of MICRO_BATCHES and the configured one),
    then whole blocks before op-level modes. Never `failed` (ac.ratio, ac.mode, micro-batch: a setting
    that ran out of memory), nor op-level modes for Gated DeltaNet hybrids (not modelled for their
    blocks), nor ac.ratio 0 with ac.offload (which would move nothing). None if nothing fits the
    GPUs, or with fsdp.cpu_offload or ac.offload the host (whose offloaded block inputs grow with the
    micro-batch and the ratio)."""
    dims = ParallelDims.of(cfg, m.gpus)
    global_batch = dims.global_batch(cfg.train.micro_batch_size, cfg.train.grad_accum_steps)
    data_parallel = dims.dp_size
    fits = [(micro < cfg.train.micro_batch_size, recompute_cost(s, cfg.data.max_seq_len, ratio, mode), -micro,
             MODES.index(mode), ratio, mode)
            for micro in {*MICRO_BATCHES, cfg.train.micro_batch_size} for ratio, mode in AC_SETTINGS
            if global_batch % (micro * data_parallel) == 0 and (ratio, mode, micro) != failed
            and (mode == "blocks" or not s.delta_blocks) and (ratio > 0 or not cfg.ac.offload)
            and predict_fit(s, cfg, m, micro, ratio, mode)[1] and not host_problem(s, cfg, m, micro, ratio)]
    if not fits:
        return None
    *_, micro, _, ratio, mode = min(fits)
    return ratio, mode, -micro, global_batch // (-micro * data_parallel)


CP_DEGREES = (1, 2, 4, 8)


def smallest_cp(s: Shapes, cfg: Config, m: Machine) -> int | None:
    """The smallest cp.degree (within a node, dividing the GPUs) at which one row of
    data.max_seq_len tokens per micro-batch fits with some activation checkpointing, or None; only
    1 for a model whose rows cannot be split."""
    for degree in CP_DEGREES if s.context_parallel else (1,):
        if m.gpus % (degree * cfg.fsdp.replicate_degree) or degree > m.gpus_on_a_node:
            continue
        at = dataclasses.replace(cfg, cp=dataclasses.replace(cfg.cp, degree=degree))
        if any(predict_fit(s, at, m, 1, ratio, mode)[1] and not host_problem(s, at, m, 1, ratio)
               for ratio, mode in AC_SETTINGS):
            return degree
    return None


def _with_offload(cfg: Config) -> Config:
    """`cfg` with ac.offload on, every block checkpointed to pass the config's checks (suggest chooses
    the ratio, never 0 with offload)."""
    return dataclasses.replace(cfg, ac=dataclasses.replace(cfg.ac, offload=True, ratio=1.0))


# The tiles plan.auto runs dense MLPs in where rows do not fit otherwise (ac.mlp_tile_tokens)
MLP_TILE_TOKENS = 16384
# What holds longer rows on the same GPUs, in the order plan.auto tries it: the blocks' inputs in host
# memory (3% of the step at 32k tokens on one H200), tiled MLPs (22% at 64k: one more MLP forward, eager
# blocks), both (docs/long-context.md)
LONG_ROW_STEPS = ({"ac.offload": True}, {"ac.mlp_tile_tokens": MLP_TILE_TOKENS},
                  {"ac.offload": True, "ac.mlp_tile_tokens": MLP_TILE_TOKENS})


def long_row_choice(s: Shapes, cfg: Config, m: Machine) -> tuple[Config, tuple[float, str, int, int], dict] | None:
    """Where nothing fits `cfg`'s GPUs (at its cp.degree): the first of LONG_ROW_STEPS the config does not
    have yet with which suggest's choice fits the GPUs and the host, as (config, choice, overrides); else
    None. Tried before a larger cp.degree, expert parallelism or leaner state: the same numerics, rows and
    global batch (a cp group trains one row on several GPUs)."""
    for step in LONG_ROW_STEPS:
        candidate = _with_offload(cfg) if step.get("ac.offload") else copy.deepcopy(cfg)
        _set(candidate, step)
        if candidate.ac == cfg.ac or range_checks(candidate, local_checks=False):
            continue  # nothing new, or refused by the config's checks
        if choice := suggest(s, candidate, m):
            return candidate, choice, {key: value for key, value in step.items()
                                       if getattr(cfg.ac, key.split(".")[1]) != value}
    return None


def host_refusal(s: Shapes, cfg: Config, m: Machine) -> str | None:
    """Why the host, not the GPUs, left `suggest` with nothing: it cannot hold the config's setting,
    or a setting the GPUs would take (ac.offload's inputs grow with the micro-batch and the ratio)."""
    if problem := host_problem(s, cfg, m):
        return problem
    return next((problem for micro in sorted({*MICRO_BATCHES, cfg.train.micro_batch_size})
                 for ratio, mode in AC_SETTINGS if predict_fit(s, cfg, m, micro, ratio, mode)[1]
                 and (problem := host_problem(s, cfg, m, micro, ratio))), None)


def nothing_fits(s: Shapes, cfg: Config, m: Machine) -> str:
    """What to change where no setting fits the GPUs; where ac.offload would fit them but not the host, the
    host memory it would need."""
    offload = ("" if cfg.fsdp.cpu_offload else "fsdp.cpu_offload=true, ") + (
        "" if cfg.ac.offload else "ac.offload=true (long rows: the blocks' inputs in host memory), ") + (
        "" if cfg.ac.mlp_tile_tokens or not s.mlp_tileable else f"ac.mlp_tile_tokens={MLP_TILE_TOKENS}, ")
    offloaded = _with_offload(cfg)
    # what plan.auto would choose with ac.offload on a node of unbounded host memory, and what it needs there
    choice = None if cfg.ac.offload else suggest(s, offloaded, dataclasses.replace(m, host_mem_gib=math.inf))
    host = (f"; ac.offload=true would fit the GPUs with {host_gib_per_node(s, offloaded, m, choice[2], choice[0]):.0f} "
            f"GiB of host memory per node ({m.host_mem_gib:.0f} GiB here)") if choice else ""
    return (f"nothing fits {m.gpu_mem_gib:.0f} GiB per GPU on {gpus_text(m.gpus)}: use more GPUs, {offload}a "
            f"larger cp.degree or a shorter data.max_seq_len{host}")


def _set(cfg: Config, overrides: dict) -> None:
    """Set "section.name" keys of `cfg` in place."""
    for key, value in overrides.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)


def text_of(overrides: dict) -> str:
    """As command-line overrides (YAML's true/false)."""
    return " ".join(f"{key}={str(value).lower() if isinstance(value, bool) else value}"
                    for key, value in overrides.items())


def roomier_layout(s: Shapes, cfg: Config, m: Machine, lean: bool = True) -> tuple[Config, tuple | None, dict] | None:
    """The first layout, in this order, with which some setting fits where `cfg`'s does not: with
    `lean` bf16 Adam moments, then also bf16 master weights and gradient reduction; then expert
    parallelism over a whole replica (MoE models: each GPU gathers only its share of a block's
    experts; the same numerics). Expert parallelism comes last because it has been slower wherever
    blocks are checkpointed (they then run eagerly): on 2 H200, the whole Moonlight-16B-A3B with 8
    bytes of state ran 11,379 tok/s/GPU without it and 6,868 with it (micro-batch 2, ac 1 attention),
    the whole Qwen3-30B-A3B 10,329 and 5,670 (ac 1 attention, docs/BENCHMARKS.md). Each step adds
    to the ones before; a step
    the config's checks refuse (sft/config/checks.py: e.g. bf16 masters with LoRA) is left out. As
    (config, suggest's choice, its overrides); where none fits, the roomiest with choice None; None
    if there is none."""
    shard_ranks = ParallelDims.of(cfg, m.gpus).shard_ranks
    steps = []
    if lean:
        steps += [{"optim.state_dtype": "bfloat16"},
                  {"optim.master_dtype": "bfloat16", "fsdp.reduce_dtype": "bfloat16"}]
    if s.experts and cfg.moe.ep_degree == 1 and shard_ranks > 1 and s.experts % shard_ranks == 0:
        steps.append({"moe.ep_degree": shard_ranks})
    roomier, overrides = cfg, {}
    for step in steps:
        candidate = copy.deepcopy(roomier)
        _set(candidate, step)
        if candidate == roomier or range_checks(candidate, local_checks=False):
            continue  # already so, or refused
        roomier, overrides = candidate, {**overrides, **step}
        if choice := suggest(s, roomier, m):
            break
    if roomier is cfg:
        return None
    return roomier, choice, overrides


def apply_auto_plan(cfg: Config, gpus: int, gpu_mem_gib: float, host_mem_gib: float | None = None,
                    gpus_per_node: int | None = None) -> str:
    """plan.auto: set ac.ratio / micro-batch / grad-acc in `cfg` from the planner; ac.offload or tiled
    MLPs (long_row_choice), then cp.degree, where rows do not fit at the configured one; where still
    nothing fits, expert parallelism (MoE) and, if plan.allow_lean_state, the optimizer's bf16 state
    (roomier_layout); return a log line. Host defaults as in Machine.of: train.py runs on one of the
    job's nodes."""
    shapes = Shapes.of(build_meta_model(cfg.model), cfg.lora)
    m = Machine.of(gpus, gpu_mem_gib, host_mem_gib, gpus_per_node)
    choice, note = suggest(shapes, cfg, m), ""
    if choice is None and (long_rows := long_row_choice(shapes, cfg, m)):
        _, choice, overrides = long_rows
        _set(cfg, overrides)
        note = text_of(overrides) + " "
    degree = smallest_cp(shapes, cfg, m) if choice is None else None
    if degree is not None and degree > cfg.cp.degree:
        # Rows do not fit at the configured degree: split them over more GPUs (fewer data-parallel
        # ranks, so the global batch has fewer rows). Before anything that changes the numerics.
        cfg.cp.degree, note = degree, f"cp.degree={degree} "
        choice = suggest(shapes, cfg, m)
    roomier = roomier_layout(shapes, cfg, m, lean=cfg.plan.allow_lean_state) if choice is None else None
    if roomier is not None and roomier[1] is not None:
        _, choice, overrides = roomier
        _set(cfg, overrides)
        note = text_of(overrides) + " "
    if choice is None:
        raise ConfigError(f"plan.auto: {host_refusal(shapes, cfg, m) or nothing_fits(shapes, cfg, m)}")
    configured = (cfg.ac.ratio, cfg.ac.mode, cfg.train.micro_batch_size, cfg.train.grad_accum_steps)
    cfg.ac.ratio, cfg.ac.mode, cfg.train.micro_batch_size, cfg.train.grad_accum_steps = choice
    predicted = predict_gib(shapes, cfg, gpus, cfg.train.micro_batch_size, cfg.ac.ratio, cfg.ac.mode)
    return (f"plan.auto: {note}{as_overrides(*choice)} (predicted {predicted:.1f} GiB per GPU"
            + ("" if choice == configured else f"; the config said {as_overrides(*configured)}") + ")")


def explain_out_of_memory(cfg: Config, world_size: int, gpu_mem_gib: float) -> None:
    """From now on, running out of GPU memory ends the run with one line: what this rank held at its
    peak, the planner's prediction for this layout, and a setting that fits, or what to change
    (worked out when it happens: no start-up cost)."""
    def explanation(error: BaseException) -> UserError:
        s = Shapes.of(build_meta_model(cfg.model), cfg.lora)
        predicted = predict_gib(s, cfg, world_size, cfg.train.micro_batch_size, cfg.ac.ratio, cfg.ac.mode)
        peak = torch.cuda.max_memory_allocated() / GIB if torch.cuda.is_available() else 0.0
        # Where this rank held more than predicted, the planner under-estimates this model: plan as if
        # every prediction were that much too low (a lower bound: the allocation that failed is not in it).
        under = peak / predicted if peak > predicted else 1.0
        failed = (cfg.ac.ratio, cfg.ac.mode, cfg.train.micro_batch_size)
        fitting = suggest(s, cfg, Machine.of(world_size, gpu_mem_gib / under), failed)
        fix = (f"nothing fits this layout; `python -m sft.plan --config <this config> --gpus {world_size} "
               f"--gpu-mem {gpu_mem_gib / under:.0f}` names one that does" if not fitting else
               f"set {as_overrides(*fitting)} (or plan.auto: true)" if under == 1.0 else
               f"the planner under-estimates this model by at least {under:.2f}x: set {as_overrides(*fitting)}, "
               f"which fits if every prediction is that much too low")
        layout = as_overrides(cfg.ac.ratio, cfg.ac.mode, cfg.train.micro_batch_size, cfg.train.grad_accum_steps)
        return UserError(f"out of GPU memory (this rank's peak {peak:.1f} GiB of {gpu_mem_gib:.0f}; the planner "
                         f"predicted {predicted:.1f} GiB per GPU for {layout}): {fix}")
    explain(torch.OutOfMemoryError, explanation)


def gpu_memory_gib(cfg: Config, device) -> float | None:
    """The GPU memory to plan for: plan.gpu_mem_gib, else the GPU's own; None on a CPU without it."""
    if cfg.plan.gpu_mem_gib:
        return cfg.plan.gpu_mem_gib
    return torch.cuda.get_device_properties(device).total_memory / GIB if device.type == "cuda" else None


def check_fits(cfg: Config, world_size: int, gpu_mem_gib: float, host_mem_gib: float | None = None,
               gpus_per_node: int | None = None) -> str | None:
    """A warning if the planner predicts this run exceeds the GPU's memory (or, with fsdp.cpu_offload
    or ac.offload, the node's host memory), else None."""
    s = Shapes.of(build_meta_model(cfg.model), cfg.lora)
    m = Machine.of(world_size, gpu_mem_gib, host_mem_gib, gpus_per_node)
    predicted, fits = predict_fit(s, cfg, m, cfg.train.micro_batch_size, cfg.ac.ratio, cfg.ac.mode)
    fraction = usable_fraction(s, cfg, cfg.ac.ratio, cfg.ac.mode)
    problems = [] if fits else [f"{predicted:.0f} GiB per GPU, more than {fraction:.0%} of {gpu_mem_gib:.0f} GiB GPUs"]
    if host_problem(s, cfg, m):
        problems.append(f"{host_gib_per_node(s, cfg, m):.0f} GiB of host memory per node for {m.host_mem_gib:.0f} GiB")
    if cfg.ac.offload and not cfg.data.packing and cfg.data.pad_to != "max_seq_len":
        # PyTorch's pinned cache keeps a block of every size the rows' inputs needed (docs/long-context.md)
        problems.append("rows of every length with ac.offload, whose host copies may take up to twice the host "
                        "memory counted (set data.packing=true or data.pad_to=max_seq_len)")
    if not problems:
        return None
    return (f"warning: the memory planner predicts {' and '.join(problems)}; see `python -m sft.plan --config "
            f"<this config> --gpus {world_size} --gpu-mem {gpu_mem_gib:.0f}`")

