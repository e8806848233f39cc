"""The run configuration: one tree of dataclasses, loaded from YAML plus dotted CLI overrides.

The field docstrings (the string literal under each field) are the documentation of every key;
`python -m sft.config` prints them as the config reference. Precedence: command-line overrides >
YAML file > defaults below. Everything is validated here, before any process group, model or
output directory exists, and all problems are reported in one `ConfigError` naming the file.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import dataclasses
import inspect
import math
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import yaml

from sft.errors import UserError, run_command


class ConfigError(UserError):
    """A configuration problem the user must fix; the message names the key and the file."""

    shared = True


# The dtype names the config accepts (fsdp.*_dtype, checkpoint.export_dtype) and what they mean.
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass
class ModelConfig:
    name_or_path: str = ""
    """Hugging Face hub id (e.g. Qwen/Qwen2.5-7B-Instruct) or a local directory with config.json
    (and *.safetensors when init=pretrained). Required."""
    init: Literal["pretrained", "random"] = "pretrained"
    """pretrained: load the safetensors weights. random: the architecture's own random init
    (demo, benchmarks); no weights are read."""
    tokenizer: str | None = None
    """Tokenizer hub id or directory; defaults to name_or_path."""
    trust_remote_code: bool = False
    """Allow custom modeling code from the hub. Off unless you trust the repository."""
    attn_implementation: str = "sdpa"
    """Attention kernel passed to transformers (sdpa, eager, flex_attention, flash_attention_2, ...)."""
    prepared_cache: str | None = None
    """A directory for a one-time sharded (DCP) copy of the loaded float32 model: the first run
    writes it, later runs of the same model load it instead of the Hugging Face files."""


@dataclass
class DataConfig:
    path: str = ""
    """Hub dataset name, or a local .jsonl / .json / .parquet file. Required."""
    subset: str | None = None
    """Hub dataset configuration name (the 'subset'), if it has several."""
    split: str = "train"
    """Split to train on."""
    max_samples: int | None = None
    """Keep only the first N rows of the file (conversations, after the seeded shuffle); the rows an
    expanded conversation trains in count as one."""
    eval_path: str | None = None
    """Optional separate held-out file or hub dataset (same format as path)."""
    eval_fraction: float = 0.0
    """Fraction of the rows held out for eval loss when eval_path is not given (0 = none). Split by
    conversation: an expanded conversation's rows stay on one side."""
    max_seq_len: int = 2048
    """Samples are truncated to this many tokens."""
    train_on: Literal["all_assistant", "last_assistant"] = "all_assistant"
    """Which assistant turns are supervised, each as generated at inference. all_assistant: every turn;
    with a chat template that rewrites history (Qwen3) a conversation becomes one row per turn group,
    repeating the history (O(turns^2) tokens; `python -m sft.data --stats` shows the cost).
    last_assistant: the final turn only, earlier turns are context; one row per conversation."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Variables for the chat template at every render, e.g. {enable_thinking: false} for Qwen3;
    use the values you will serve with."""
    pad_to: Literal["longest", "max_seq_len"] = "longest"
    """Right-pad each micro-batch to its longest sample, or always to max_seq_len (benchmarks)."""
    packing: bool = False
    """Pack samples into rows of max_seq_len tokens (best-fit decreasing), no attention across
    samples: no padding waste. On GPUs pair it with model.attn_implementation: flex_attention."""
    pad_to_multiple_of: int = 64
    """Round padded lengths up to a multiple of this, so compiled blocks see few shapes."""
    num_proc: int = 1
    """Processes for tokenisation (datasets.map)."""
    cache_dir: str | None = None
    """datasets cache directory (tokenised data is cached there; a rerun starts fast)."""


@dataclass
class TrainConfig:
    output_dir: str = "runs"
    """Parent directory of run directories."""
    run_name: str = "sft"
    """The run directory is output_dir/run_name."""
    seed: int = 0
    """Seeds data order, random init and every RNG."""
    epochs: int = 1
    """Passes over the training data (ignored when max_steps is set)."""
    max_steps: int | None = None
    """Stop after this many optimizer steps."""
    micro_batch_size: int = 1
    """Sequences per GPU (per rank) per forward/backward."""
    grad_accum_steps: int = 1
    """Micro-batches per optimizer step. Global batch = micro_batch_size x grad_accum_steps x ranks."""
    overwrite: bool = False
    """Allow writing into a run directory that already holds a finished run."""


@dataclass
class OptimConfig:
    lr: float = 1e-5
    """Peak learning rate (AdamW)."""
    min_lr: float = 0.0
    """Learning rate at the end of the cosine decay."""
    warmup_ratio: float = 0.0
    """Fraction of the optimizer steps spent in linear warmup."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW)."""
    decay_norms_and_biases: bool = False
    """Also apply weight decay to 1-D parameters (norm weights, biases). Usually off."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    clip_grad_norm: float | None = 1.0
    """Clip the global gradient norm to this value (null = no clipping; the norm is still logged)."""


@dataclass
class FSDPConfig:
    param_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Compute dtype of the all-gathered parameters. Master weights are always float32."""
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the gradient reduce-scatter. bfloat16 halves traffic at some precision cost; with
    float32 master weights it measured slower near the memory limit (its float32 copies of the
    gradients bring back allocator retries: sft/parallel.py:GradientsInComputePool)."""
    reshard_after_forward: bool = True
    """Free gathered blocks after their forward (ZeRO-3). False keeps them until backward (≈ZeRO-2)."""
    replicate_degree: int = 1
    """HSDP: >1 replicates the model over this many groups and shards within each (e.g. the number
    of nodes, so all-gathers stay inside a node). Must divide the number of ranks."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer states in host memory (CPUOffloadPolicy)."""
    sync_grads_each_microbatch: bool = True
    """Reduce-scatter gradients after every micro-batch. False defers it to the last micro-batch of
    the step (less communication, but unsharded gradients stay in memory)."""


@dataclass
class PrecisionConfig:
    float8: Literal["none", "tensorwise", "rowwise"] = "none"
    """Float8 matmuls in the decoder blocks' Linear layers (torchao; pip install -e '.[fp8]'), on
    GPUs of compute capability >= 8.9 (H100, H200, L40S), with compile.enabled. tensorwise: one
    scale per tensor and float8 FSDP all-gathers, the fastest; rowwise: one scale per row, more
    accurate, slower. The lm_head and embeddings stay bf16; master weights, Adam moments and
    checkpoints stay float32 with the same keys as without float8 (none <-> float8 resume works)."""


@dataclass
class ACConfig:
    ratio: float = 0.0
    """Fraction of decoder blocks wrapped in activation checkpointing, spread evenly over depth
    (0 = none, 1 = all). See sft/parallel.py:ac_block_indices for the exact blocks."""
    mode: Literal["blocks", "ops", "ops_half", "attention"] = "blocks"
    """How a checkpointed block saves memory. blocks: keep only its input and recompute the whole
    block in backward (least memory). ops: keep the outputs of its matmuls and of attention (output
    and log-sum-exp) and recompute only the cheap ops around them (norms, rotary, SiLU): almost no
    recomputation, ~70% of an unchecked block's activations on Qwen2.5-7B shapes. ops_half: the same
    but every second matmul is recomputed (TorchTitan's default): ~40% of the activations. attention:
    keep only attention's output and log-sum-exp and recompute everything else, matmuls included:
    at long context the most expensive kernel is not rerun, for one more bf16 vector per token per
    block. python -m sft.plan shows the memory of each; works with compile, float8, packing and FSDP2."""


@dataclass
class MoEConfig:
    aux_loss_coef: float | None = None
    """Coefficient of the load-balancing loss of mixture-of-experts models (null: the model's
    router_aux_loss_coef from config.json, e.g. 0.001 for Qwen3-MoE; 0 turns it off). Switch-style,
    per layer over each micro-batch's real tokens, weighted so the step's total does not depend on
    ranks or grad-accum steps (sft/moe.py says exactly what is computed)."""
    train_router: bool = True
    """Train the routers. False freezes them (the load-balancing loss then only reaches the hidden
    states through the router's input; set aux_loss_coef: 0 to drop it)."""
    router_fp32: bool = True
    """Compute router logits, softmax and top-k in float32 from the upcast hidden states and gathered
    router weight (under fsdp.param_dtype=bfloat16 that weight is its bf16-rounded copy), so close
    scores pick experts as a float32 model would; false computes the logits in fsdp.param_dtype."""


@dataclass
class CPConfig:
    degree: int = 1
    """Context parallelism: split every row's tokens over this many ranks (consecutive ranks, so
    keep it within a node), for rows longer than one GPU's activations allow (python -m sft.plan
    suggests the smallest degree that fits data.max_seq_len). Keys and values are all-gathered per
    layer and documents of packed rows stay isolated. Must divide the number of ranks; the data
    is spread over ranks / degree data-parallel groups, so the global batch is micro_batch_size x
    grad_accum_steps x ranks / degree. Checkpoints resume at any degree. See README "Long context"."""


@dataclass
class CompileConfig:
    enabled: bool = False
    """torch.compile each decoder block (after activation checkpointing, before FSDP)."""


@dataclass
class EvalConfig:
    every_steps: int = 0
    """Compute the held-out loss every N optimizer steps (0 = only before and after training)."""


@dataclass
class CheckpointConfig:
    enabled: bool = True
    """Write checkpoints (at the end, every_steps, and on SIGTERM/SIGUSR1). Off for benchmarks."""
    every_steps: int = 0
    """Save a checkpoint every N optimizer steps (0 = only at the end, and on SIGTERM/SIGUSR1)."""
    keep_last: int = 2
    """Keep this many committed checkpoints; older ones are deleted after a new one is committed."""
    async_save: bool = True
    """Periodic saves (every_steps) write in the background: training waits only while each rank's
    shards are copied to host memory (12 bytes x parameters / ranks per rank: fp32 weights and both
    Adam moments, kept for the run). The checkpoint is committed once every rank has written it.
    The final save and the stop-save (SIGTERM/SIGUSR1) are always synchronous."""
    resume: str = "auto"
    """auto: continue from the newest complete checkpoint of this run, if any; none: start fresh;
    or the path of a checkpoints/step-N directory."""
    export_hf: bool = False
    """At the end, also write a Hugging Face model directory to <run>/export."""
    export_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Dtype of the exported weights."""

    @property
    def most_on_disk(self) -> int:
        """Checkpoints on disk at once while saving: keep_last committed ones stay while the next is
        written (retention runs only after its commit)."""
        return self.keep_last + 1

    @property
    def stages_in_host_memory(self) -> bool:
        """Whether periodic asynchronous saves keep a host copy of the sharded state for the run."""
        return self.enabled and self.async_save and self.every_steps > 0


@dataclass
class LoggingConfig:
    every_steps: int = 1
    """Print a log line every N optimizer steps (metrics.jsonl always gets every step)."""
    progress: Literal["auto", "bar", "lines"] = "auto"
    """bar: a progress bar instead of per-step log lines; lines: log lines; auto: the bar only when
    stdout is a terminal (so Slurm logs get plain lines)."""
    tensorboard: bool = False
    """Also write scalars to <run>/tb for TensorBoard (pip install tensorboard)."""
    wandb_project: str | None = None
    """Also log to this Weights & Biases project (pip install wandb)."""
    profile_steps: tuple[int, int] | None = None
    """[first, last]: trace these optimizer steps on rank 0 with torch.profiler into <run>/profile
    (a Perfetto/chrome://tracing trace and summary.txt: GPU time by kernel class, idle and
    exposed-communication time; on GPUs also the allocator's memory by stream and what was alive
    at the steps' peak of allocated memory, by where it was allocated, with memory-rank0.pickle for
    pytorch.org/memory_viz). Skip the first steps: they compile. Traced steps run slower and
    keep their allocation history in host memory (a few KB per allocation)."""


@dataclass
class DistConfig:
    timeout_minutes: float = 15.0
    """Timeout of every collective: a rank that died or hangs stops the others after this long
    instead of leaving them waiting. Work that keeps ranks waiting for longer (rank 0 tokenising a
    large dataset on the first run) waits outside it; the HF export runs after the process group
    is gone."""


@dataclass
class PlanConfig:
    auto: bool = False
    """On GPUs, let the memory planner (python -m sft.plan) choose ac.ratio, ac.mode,
    train.micro_batch_size and train.grad_accum_steps, keeping the global batch: the least
    recomputation that fits with room to spare for the allocator (sft/plan.py:suggest)."""
    gpu_mem_gib: float | None = None
    """Memory per GPU to plan for (default: the GPU's total memory). Set, it also lets plan.auto
    choose without a GPU (e.g. to see its choice on a CPU machine)."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    ac: ACConfig = field(default_factory=ACConfig)
    cp: CPConfig = field(default_factory=CPConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.train.output_dir) / self.train.run_name

    @property
    def checkpoints_dir(self) -> Path:
        return self.run_dir / "checkpoints"


def _range_checks(cfg: Config, local_checks: bool) -> list[str]:
    """Cross-field and value checks; each entry is 'key=value: what is wrong and what to do'."""
    problems = []

    def check(ok: bool, key: str, value: Any, why: str) -> None:
        if not ok:
            problems.append(f"{key}={value!r}: {why}")

    check(bool(cfg.model.name_or_path), "model.name_or_path", cfg.model.name_or_path,
          "required: a hub id or a local model directory")
    check(bool(cfg.data.path), "data.path", cfg.data.path,
          "required: a hub dataset name or a local .jsonl/.json/.parquet file")
    check(0.0 <= cfg.ac.ratio <= 1.0, "ac.ratio", cfg.ac.ratio, "must be in [0, 1]")
    check(cfg.optim.lr > 0, "optim.lr", cfg.optim.lr, "must be > 0")
    check(0 <= cfg.optim.min_lr <= cfg.optim.lr, "optim.min_lr", cfg.optim.min_lr, "must be in [0, optim.lr]")
    check(0.0 <= cfg.optim.warmup_ratio < 1.0, "optim.warmup_ratio", cfg.optim.warmup_ratio, "must be in [0, 1)")
    check(cfg.optim.weight_decay >= 0, "optim.weight_decay", cfg.optim.weight_decay, "must be >= 0")
    check(all(0 <= b < 1 for b in cfg.optim.betas), "optim.betas", cfg.optim.betas, "each must be in [0, 1)")
    check(cfg.optim.eps > 0, "optim.eps", cfg.optim.eps, "must be > 0")
    check(cfg.optim.clip_grad_norm is None or cfg.optim.clip_grad_norm > 0, "optim.clip_grad_norm",
          cfg.optim.clip_grad_norm, "must be > 0, or null to disable clipping")
    check(cfg.train.grad_accum_steps >= 1, "train.grad_accum_steps", cfg.train.grad_accum_steps, "must be >= 1")
    check(cfg.train.micro_batch_size >= 1, "train.micro_batch_size", cfg.train.micro_batch_size, "must be >= 1")
    check(cfg.train.epochs >= 1, "train.epochs", cfg.train.epochs, "must be >= 1")
    check(cfg.train.max_steps is None or cfg.train.max_steps >= 1, "train.max_steps", cfg.train.max_steps,
          "must be >= 1, or null to train for train.epochs")
    check(bool(cfg.train.run_name) and "/" not in cfg.train.run_name, "train.run_name", cfg.train.run_name,
          "must be a non-empty directory name without '/'")
    check(cfg.data.max_seq_len >= 2, "data.max_seq_len", cfg.data.max_seq_len, "must be >= 2")
    reserved = sorted(set(cfg.data.chat_template_kwargs) & {"messages", "tools", "documents", "add_generation_prompt",
                                                             "continue_final_message", "chat_template"})
    check(not reserved, "data.chat_template_kwargs", cfg.data.chat_template_kwargs,
          f"{', '.join(reserved)} are set by the trainer at each render; remove them")
    check(cfg.data.pad_to_multiple_of >= 1, "data.pad_to_multiple_of", cfg.data.pad_to_multiple_of, "must be >= 1")
    check(cfg.data.max_samples is None or cfg.data.max_samples >= 1, "data.max_samples", cfg.data.max_samples,
          "must be >= 1, or null for all rows")
    check(0.0 <= cfg.data.eval_fraction < 1.0, "data.eval_fraction", cfg.data.eval_fraction, "must be in [0, 1)")
    check(cfg.data.num_proc >= 1, "data.num_proc", cfg.data.num_proc, "must be >= 1")
    check(cfg.cp.degree >= 1, "cp.degree", cfg.cp.degree, "must be >= 1 (1 = no context parallelism)")
    check(cfg.fsdp.replicate_degree >= 1, "fsdp.replicate_degree", cfg.fsdp.replicate_degree, "must be >= 1")
    check(cfg.moe.aux_loss_coef is None or cfg.moe.aux_loss_coef >= 0, "moe.aux_loss_coef", cfg.moe.aux_loss_coef,
          "must be >= 0, or null for the model's router_aux_loss_coef")
    check(cfg.eval.every_steps >= 0, "eval.every_steps", cfg.eval.every_steps, "must be >= 0")
    check(cfg.checkpoint.every_steps >= 0, "checkpoint.every_steps", cfg.checkpoint.every_steps, "must be >= 0")
    check(cfg.checkpoint.enabled or not cfg.checkpoint.export_hf, "checkpoint.export_hf", cfg.checkpoint.export_hf,
          "exports from the final checkpoint: needs checkpoint.enabled=true")
    check(cfg.dist.timeout_minutes > 0, "dist.timeout_minutes", cfg.dist.timeout_minutes, "must be > 0")
    check(cfg.checkpoint.keep_last >= 1, "checkpoint.keep_last", cfg.checkpoint.keep_last, "must be >= 1")
    check(cfg.checkpoint.resume in ("auto", "none") or not local_checks or Path(cfg.checkpoint.resume).is_dir(),
          "checkpoint.resume", cfg.checkpoint.resume, "must be auto, none, or an existing checkpoints/step-N directory")
    for key, enabled, package in (("logging.tensorboard", cfg.logging.tensorboard, "tensorboard"),
                                  ("logging.wandb_project", cfg.logging.wandb_project, "wandb")):
        check(not enabled or not local_checks or importlib.util.find_spec(package) is not None, key, enabled,
              f"needs the {package} package: pip install {package} (or turn it off)")
    if cfg.precision.float8 != "none":
        problems += _float8_checks(cfg, local_checks)
    check(cfg.logging.every_steps >= 1, "logging.every_steps", cfg.logging.every_steps, "must be >= 1")
    check(cfg.logging.profile_steps is None or 1 <= cfg.logging.profile_steps[0] <= cfg.logging.profile_steps[1],
          "logging.profile_steps", cfg.logging.profile_steps, "must be [first, last] with 1 <= first <= last")
    if local_checks:
        problems += _attention_checks(cfg.model.attn_implementation)
    for key, value in (("data.path", cfg.data.path), ("data.eval_path", cfg.data.eval_path)):
        if value and local_checks and is_local_path(value):
            check(Path(value).expanduser().exists(), key, value,
                  "file not found; give an existing file or a hub dataset name")
    return problems


# The module each of transformers' flash attention kernels imports (FA4 ships inside flash_attn).
_FLASH_ATTENTION_MODULES = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface",
                            "flash_attention_4": "flash_attn"}


def _attention_checks(name: str) -> list[str]:
    """model.attn_implementation: a name transformers knows (asked of transformers, so the kernels of
    a newer version are accepted), whose package is installed. Whether the kernel runs on this
    machine's GPU is transformers' own check when the model is built (sft/model.py)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    key = f"model.attn_implementation={name!r}"
    known = ["eager", *ALL_ATTENTION_FUNCTIONS.valid_keys()]
    if name not in known and "/" not in name:  # org/repo: a kernel from the hub (the kernels package)
        return [f"{key}: not an attention implementation transformers knows (one of {', '.join(sorted(known))})"]
    module = _FLASH_ATTENTION_MODULES.get(name, "kernels" if "/" in name else None)
    if module and importlib.util.find_spec(module) is None:
        return [f"{key}: needs the {module} package, which is not installed here; install it, or use sdpa "
                "(or flex_attention for packed rows)"]
    return []


def _float8_checks(cfg: Config, local_checks: bool) -> list[str]:
    """precision.float8 with the rest of the config (its GPU requirement is in check_machine)."""
    key = f"precision.float8={cfg.precision.float8!r}"
    problems = []
    if local_checks and importlib.util.find_spec("torchao") is None:
        problems.append(f"{key}: needs torchao: pip install -e '.[fp8]' (or set precision.float8=none)")
    if not cfg.compile.enabled:
        # Eager float8 runs each scale and cast as its own kernel: slower than plain bf16.
        problems.append(f"{key}: needs compile.enabled=true (without compile float8 is slower than bfloat16)")
    if cfg.fsdp.param_dtype != "bfloat16":
        # Only the blocks' matmuls run in float8; everything around them computes in param_dtype.
        problems.append(f"{key}: needs fsdp.param_dtype=bfloat16 (float8 replaces bfloat16 matmuls)")
    if cfg.fsdp.cpu_offload:
        # Float8 all-gather and its precomputed scales work on GPU shards; untested with offload.
        problems.append(f"{key}: not supported with fsdp.cpu_offload=true; turn one of them off")
    return problems


def check_machine(cfg: Config, device: torch.device) -> None:
    """Checks of settings that depend on the machine that trains (GPU-only features).

    Called by train.py once the device is known, never at parse time: planning a GPU run
    (python -m sft.plan, python -m sft.config) must work on a login node without GPUs.
    """
    problems = []
    if cfg.fsdp.cpu_offload and device.type != "cuda":
        problems.append(f"fsdp.cpu_offload={cfg.fsdp.cpu_offload!r}: offloads GPU training state to host memory: "
                        "needs GPUs (set it to false on a CPU-only machine)")
    if cfg.precision.float8 != "none":
        key = f"precision.float8={cfg.precision.float8!r}"
        if device.type != "cuda":
            problems.append(f"{key}: float8 matmuls need NVIDIA GPUs of compute capability >= 8.9 (H100, H200, "
                            "L40S); set precision.float8=none on this machine")
        elif torch.cuda.get_device_capability(device) < (8, 9):
            name, capability = torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device)
            problems.append(f"{key}: {name} has compute capability {capability[0]}.{capability[1]}; float8 "
                            "matmuls need >= 8.9 (H100, H200, L40S): set precision.float8=none")
    if problems:
        raise ConfigError("invalid config for this machine:\n  - " + "\n  - ".join(problems))


DATA_FILE_SUFFIXES = (".jsonl", ".json", ".parquet")


def is_local_path(path: str) -> bool:
    """Whether `path` (a model, tokenizer, dataset or export) names something on this machine rather
    than the hub: it starts with / . or ~, names a data file, or has more '/' than a hub id
    ('name' or 'org/name'). The one rule every loader and check asks."""
    return path.startswith(("/", ".", "~")) or path.endswith(DATA_FILE_SUFFIXES) or path.count("/") > 1


def _coerce(value: Any, annotation: Any, key: str) -> Any:
    """Return `value` converted to `annotation`, or raise TypeError saying what was expected."""
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType:
        args = typing.get_args(annotation)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except TypeError as e:
                errors.append(str(e))
        raise TypeError(" or ".join(errors) + (" or null" if type(None) in args else ""))
    if origin is Literal:
        choices = typing.get_args(annotation)
        if value not in choices:
            raise TypeError(f"one of {list(choices)}")
        return value
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise TypeError("a mapping of names to values")
        return dict(value)
    if origin is tuple:
        args = typing.get_args(annotation)
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise TypeError(f"a list of {len(args)} values")
        return tuple(_coerce(v, a, key) for v, a in zip(value, args))
    if annotation is bool:
        if not isinstance(value, bool):
            raise TypeError("true or false")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError("an integer")
        return value
    if annotation is float:
        # YAML 1.1 reads `1e-5` as a string; accept any number written in Python syntax.
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                raise TypeError("a number") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise TypeError("a finite number")
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            raise TypeError("a string")
        return value
    raise AssertionError(f"unsupported config annotation {annotation!r} for {key}")


def _build_section(cls: type, values: dict, prefix: str, problems: list[str]) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in values.items():
        dotted = f"{prefix}{key}"
        if key not in hints:
            problems.append(f"{dotted}: unknown key (valid keys{' in ' + prefix[:-1] if prefix else ''}: "
                            f"{', '.join(names)})")
            continue
        annotation = hints[key]
        if dataclasses.is_dataclass(annotation):
            if not isinstance(value, dict):
                problems.append(f"{dotted}: must be a mapping of keys ({', '.join(f.name for f in dataclasses.fields(annotation))})")
                continue
            kwargs[key] = _build_section(annotation, value, f"{dotted}.", problems)
            continue
        try:
            kwargs[key] = _coerce(value, annotation, dotted)
        except TypeError as e:
            problems.append(f"{dotted}={value!r}: expected {e}")
    return cls(**kwargs)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    node = tree
    *parents, leaf = dotted.split(".")
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted}: {part} is not a section")
        node = child
    node[leaf] = value


def load_config(path: str | Path | None, overrides: list[str] = (), local_checks: bool = True) -> Config:
    """Read YAML at `path` (may be None), apply `key.sub=value` overrides, validate, return Config.
    `local_checks=False`: do not require the files the config names (data, resume checkpoint) or the
    optional packages it asks for to exist here, for tools that only read the config (the planner,
    on a login node)."""
    source = str(path) if path else "<defaults>"
    tree: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {source} not found")
        try:
            tree = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{source}: not valid YAML: {e}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"{source}: the top level must be a mapping of sections (model:, data:, ...)")
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r}: write overrides as section.key=value (e.g. ac.ratio=0.5)")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as e:
            problem = " ".join(str(getattr(e, "problem", None) or e).split())
            raise ConfigError(f"{source}: override {item!r}: the value is not valid YAML ({problem}); write it as YAML, "
                              "e.g. 'data.chat_template_kwargs={enable_thinking: false}', quoted for the shell") from None
        _set_dotted(tree, key.strip(), value)
    problems: list[str] = []
    cfg = _build_section(Config, tree, "", problems)
    if not problems:
        problems = _range_checks(cfg, local_checks)
    if problems:
        where = source + (f" with overrides {list(overrides)}" if overrides else "")
        raise ConfigError(f"invalid config ({where}):\n  - " + "\n  - ".join(problems))
    return cfg


def to_yaml(cfg: Config) -> str:
    def plain(obj: Any) -> Any:
        if isinstance(obj, dict):
            return {k: plain(v) for k, v in obj.items()}
        if isinstance(obj, tuple):
            return list(obj)
        return obj

    return yaml.safe_dump(plain(dataclasses.asdict(cfg)), sort_keys=False)


def parse_args(argv: list[str] | None = None) -> Config:
    """`--config path.yaml key.sub=value ...` -> validated Config."""
    parser = argparse.ArgumentParser(description="Full-parameter SFT with FSDP2.")
    parser.add_argument("--config", required=True, help="YAML file (see configs/ and `python -m sft.config`)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. ac.ratio=0.5 optim.lr=2e-5")
    args = parser.parse_args(argv)
    return load_config(args.config, args.overrides)


def field_docs(cls: type) -> dict[str, str]:
    """Map field name -> the docstring literal that follows it in the class body."""
    docs: dict[str, str] = {}
    body = ast.parse(inspect.getsource(cls)).body[0].body
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def reference_markdown() -> str:
    """The config reference table (README section), generated from the dataclasses."""
    lines = []
    for section in dataclasses.fields(Config):
        cls = typing.get_type_hints(Config)[section.name]
        docs = field_docs(cls)
        lines += [f"### `{section.name}`", "", "| key | default | meaning |", "|---|---|---|"]
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            lines.append(f"| `{section.name}.{f.name}` | `{default!r}` | {docs.get(f.name, '')} |")
        lines.append("")
    return "\n".join(lines)


README_MARKERS = ("<!-- config-reference:start -->\n", "<!-- config-reference:end -->")


def update_readme(path: Path) -> None:
    """Rewrite the config reference between the README's markers from the dataclasses."""
    text = path.read_text()
    start, end = text.index(README_MARKERS[0]) + len(README_MARKERS[0]), text.index(README_MARKERS[1])
    path.write_text(text[:start] + reference_markdown() + text[end:])


def main(argv: list[str] | None = None) -> None:
    # python -m sft.config                      -> the config reference (markdown)
    # python -m sft.config --readme README.md   -> refresh the README's copy of it
    # python -m sft.config CONFIG [overrides]   -> the resolved config, validated
    # python -m sft.config --run-dir CONFIG [overrides]  -> the run directory (slurm/train.slurm)
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--readme"]:
        update_readme(Path(args[1]))
    elif args[:1] == ["--run-dir"]:
        print(load_config(args[1], args[2:]).run_dir)
    elif args:
        print(to_yaml(load_config(args[0], args[1:])), end="")
    else:
        print(reference_markdown(), end="")


if __name__ == "__main__":
    run_command(main)
