"""Validation of a loaded config: each problem one line 'key=value: what is wrong and what to do',
all of a config's problems in one ConfigError naming the file; and the checks of settings that
depend on the machine that trains."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from sft.config.paths import is_local_path
from sft.config.schema import Config
from sft.errors import UserError


class ConfigError(UserError):
    """A configuration problem the user must fix; the message names the key and the file."""

    shared = True


def range_checks(cfg: Config, local_checks: bool) -> list[str]:
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
    check(not cfg.ac.offload or cfg.ac.ratio > 0 or cfg.plan.auto, "ac.offload", cfg.ac.offload,
          "keeps the checkpointed blocks' inputs in host memory: set ac.ratio > 0 too (or plan.auto=true)")
    check(cfg.ac.mlp_tile_tokens >= 0, "ac.mlp_tile_tokens", cfg.ac.mlp_tile_tokens, "must be >= 0 (0 = off)")
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
    _state_and_moe_checks(cfg, check)
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
    problems += _lora_checks(cfg, local_checks)
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


def _state_and_moe_checks(cfg: Config, check: Callable[[bool, str, Any, str], None]) -> None:
    """range_checks' of the optimizer state's dtypes, expert parallelism and routing, through its `check`."""
    check(cfg.optim.master_dtype == "float32"
          or (cfg.fsdp.param_dtype == cfg.fsdp.reduce_dtype == "bfloat16" and not cfg.lora.enabled
              and not cfg.fsdp.cpu_offload and cfg.fsdp.replicate_degree == 1),
          "optim.master_dtype", cfg.optim.master_dtype, "bfloat16 master weights need fsdp.param_dtype=bfloat16 and "
          "fsdp.reduce_dtype=bfloat16, and not LoRA (lora.rank > 0: its adapters' state is small), fsdp.cpu_offload "
          "or fsdp.replicate_degree > 1 (each replica would round its copy apart); set those, or "
          "optim.master_dtype=float32")
    check(cfg.optim.state_dtype == "float32" or not (cfg.fsdp.cpu_offload or cfg.fsdp.replicate_degree > 1),
          "optim.state_dtype", cfg.optim.state_dtype, "bfloat16 moments do not combine with fsdp.cpu_offload (its "
          "state is in host memory) or fsdp.replicate_degree > 1 (each replica would round its copy apart); set "
          "optim.state_dtype=float32")
    check(cfg.moe.ep_degree >= 1, "moe.ep_degree", cfg.moe.ep_degree, "must be >= 1 (1 = no expert parallelism)")
    check(cfg.moe.bias_update_rate >= 0, "moe.bias_update_rate", cfg.moe.bias_update_rate,
          "must be >= 0 (0 keeps the checkpoint's correction bias)")
    check(not (cfg.moe.bias_update_rate and cfg.lora.enabled), "moe.bias_update_rate", cfg.moe.bias_update_rate,
          "a LoRA run keeps the base's correction bias frozen (its checkpoints hold the adapters alone); set it to 0")
    check(cfg.plan.auto or not cfg.plan.allow_lean_state, "plan.allow_lean_state", cfg.plan.allow_lean_state,
          "lets plan.auto choose bfloat16 optimizer state, and does nothing without it: set plan.auto=true, or set "
          "optim.state_dtype / optim.master_dtype yourself")
    check(cfg.moe.ep_degree <= 1 or (cfg.fsdp.replicate_degree == 1 and cfg.lora.base != "nf4"),
          "moe.ep_degree", cfg.moe.ep_degree, "expert parallelism does not combine with fsdp.replicate_degree > 1 "
          "or QLoRA's lora.base=nf4 (whole on every rank) yet; set moe.ep_degree=1")
    check(cfg.moe.aux_loss_coef is None or cfg.moe.aux_loss_coef >= 0, "moe.aux_loss_coef", cfg.moe.aux_loss_coef,
          "must be >= 0, or null for the model's router_aux_loss_coef")


# The module each of transformers' flash attention kernels imports (FA4 ships inside flash_attn).
_FLASH_ATTENTION_MODULES = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface",
                            "flash_attention_4": "flash_attn"}


def _attention_checks(name: str) -> list[str]:
    """model.attn_implementation: a name transformers knows (asked of transformers, so the kernels of
    a newer version are accepted), whose package is installed. Whether the kernel runs on this
    machine's GPU is transformers' own check when the model is built (sft/models/)."""
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


def _lora_checks(cfg: Config, local_checks: bool) -> list[str]:
    """The lora section, and what it combines with."""
    lora, problems = cfg.lora, []
    if lora.rank < 0:
        problems.append(f"lora.rank={lora.rank}: must be >= 0 (0 = full fine-tuning)")
    if not lora.enabled:
        if lora.base != "bfloat16":
            problems.append(f"lora.base={lora.base!r}: the frozen base of LoRA, and lora.rank=0 trains every parameter "
                            "(full fine-tuning); set lora.rank > 0 for QLoRA, or remove lora.base")
        return problems
    if lora.alpha <= 0:
        problems.append(f"lora.alpha={lora.alpha}: must be > 0")
    if not 0 <= lora.dropout < 1:
        problems.append(f"lora.dropout={lora.dropout}: must be in [0, 1)")
    if not lora.target_modules:
        problems.append("lora.target_modules=[]: name at least one Linear layer (or all-linear)")
    if lora.base != "nf4":
        return problems
    if cfg.precision.float8 != "none":
        problems.append(f"precision.float8={cfg.precision.float8!r}: not with lora.base='nf4' (the 4-bit base "
                        "dequantises to bfloat16 for its matmuls); set precision.float8=none or lora.base=bfloat16")
    if local_checks and importlib.util.find_spec("torchao") is None:
        problems.append("lora.base='nf4': needs torchao: pip install -e '.[fp8]' (or lora.base=bfloat16)")
    if cfg.fsdp.cpu_offload:
        # NF4 weights are not FSDP's (sft/adapters/lora.py): they would stay in host memory.
        problems.append("lora.base='nf4': not with fsdp.cpu_offload=true (the 4-bit base is meant to fit the GPU); "
                        "turn one of them off")
    if cfg.model.prepared_cache:
        # The cache holds bfloat16 shards; NF4 weights are quantised whole as they load.
        problems.append("lora.base='nf4': not with model.prepared_cache; remove model.prepared_cache")
    return problems


def _float8_checks(cfg: Config, local_checks: bool) -> list[str]:
    """precision.float8 with the rest of the config (its GPU requirement is in check_machine)."""
    key = f"precision.float8={cfg.precision.float8!r}"
    problems = []
    if local_checks and not cfg.lora.enabled and importlib.util.find_spec("torchao") is None:  # LoRA's is ours
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
