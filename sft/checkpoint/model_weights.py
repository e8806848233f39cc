"""The one place that decides where a model's own weights come from when no checkpoint holds them:
the prepared-model cache (`model.prepared_cache`, a DCP checkpoint of the float32 weights, written by
the first run that asks for it), the Hugging Face files or random init (sft/hub/weights.py reads them)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from sft.checkpoint.commit import AllRanksCommit
from sft.checkpoint.layout import checkpoint_problem
from sft.checkpoint.reader import read_checkpoint
from sft.config import Config
from sft.distributed import DistEnv, decided_on_rank0
from sft.hub.layout import is_adapter
from sft.hub.weights import initial_weights, load_weights


def _base_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict without LoRA adapters: what the prepared-model cache holds."""
    return {name: value for name, value in get_model_state_dict(model).items() if not is_adapter(name)}


def load_model_weights(cfg: Config, model: nn.Module, env: DistEnv) -> tuple[str, Path | None]:
    """Collective: fill the model's own weights (LoRA adapters start from their own initialisation),
    writing the prepared-model cache where it is asked for and missing; return what was loaded, for
    the log, and the cache they came from, if they did."""
    prepared = Path(cfg.model.prepared_cache) if cfg.model.prepared_cache else None
    if prepared is not None and decided_on_rank0(lambda: checkpoint_problem(prepared, ())) is None:
        state = {"model": _base_state(model)}
        read_checkpoint(state, prepared)  # cast to each parameter's dtype (a LoRA base: bf16)
        set_model_state_dict(model, state["model"], options=StateDictOptions(strict=False))
        return f"loaded the prepared-model cache {prepared}", prepared
    load_weights(model, initial_weights(cfg.model, cfg.train.seed, model), env.device)
    source = cfg.model.name_or_path if cfg.model.init == "pretrained" else "random init"
    if prepared is None:
        return f"loaded weights from {source}", None
    if any(p.dtype != torch.float32 for p in model.parameters()):
        # A LoRA base or bf16 masters: a cache of them would give a later float32 run rounded weights.
        return f"loaded weights from {source}; the prepared-model cache is written by float32 runs only", None
    with AllRanksCommit(prepared, env) as tmp:
        dcp.save({"model": _base_state(model)}, checkpoint_id=tmp)
    return f"loaded weights from {source}; wrote the prepared-model cache {prepared}", None
