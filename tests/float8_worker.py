"""Run under torchrun by tests/integration/test_float8.py: float8 through the real FSDP2 path on gloo ranks.

Builds the model as train.py does with `--float8` (no compile: CPU tests stay fast), loads the
random init, or resumes from `--resume` (a checkpoint written by
either precision), trains `--steps` steps on a fixed batch, and saves a checkpoint to `--save`.
With `--reload-as RECIPE` a second model converted with RECIPE then loads that checkpoint.
Writes what the test asserts on from rank 0 to --out.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from helpers import synthetic_global_batch
from sft.checkpoint.manager import Checkpointer
from sft.data.collate import collate
from sft.errors import run_command
from sft.config import Config, FSDPConfig, ModelConfig, OptimConfig, PrecisionConfig
from sft.distributed import all_reduce_sum, init_distributed
from sft.parallel.float8 import fuse_weight_casts, precompute_scales_after_each_step
from sft.training.loss import forward_backward, loss_inputs, on_device
from sft.models.build import clean_name
from sft.hub.tokenizer import load_tokenizer
from sft.hub.weights import initial_weights, load_weights
from sft.training.optim import build_optimizer, build_scheduler
from sft.parallel.mesh import ParallelDims
from sft.training.model import TrainingModel, build_training_model


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    # DTensor -> plain tensor of the whole parameter; the float8 weight wrapper is unwrapped too.
    return {clean_name(n): (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().clone()
            for n, p in model.named_parameters()}


def build(model_cfg: ModelConfig, recipe: str, env, dims) -> tuple[TrainingModel, torch.optim.Optimizer, object]:
    """The model as train.py builds it (sft/training/model.py), bf16 compute with precision.float8=`recipe`."""
    cfg = Config(model=model_cfg, fsdp=FSDPConfig(param_dtype="bfloat16"), precision=PrecisionConfig(float8=recipe))
    built = build_training_model(cfg, dims, env.device)
    optimizer = build_optimizer(built.model, OptimConfig(lr=1e-3))
    return built, optimizer, build_scheduler(optimizer, OptimConfig(lr=1e-3), total_steps=10)


@torch.no_grad()
def loss_at_current_weights(built: TrainingModel, batch: dict, env) -> float:
    inputs = loss_inputs(batch)
    ce = built.loss(**on_device(inputs, env.device)).double()
    ce, n = all_reduce_sum([ce.item(), len(inputs["target_ids"])], env.device).tolist()
    return ce / n


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--float8", default="none")
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--resume")
    p.add_argument("--save")
    p.add_argument("--reload-as")
    p.add_argument("--fuse-casts", action="store_true", help="the float8 all-gather's compiled cast, as with compile")
    args = p.parse_args()

    env = init_distributed()
    torch.manual_seed(0)
    model_cfg = ModelConfig(name_or_path=args.model, init="random")
    dims = ParallelDims(env.world_size, rank=env.rank).build(env.device.type)
    built, optimizer, scheduler = build(model_cfg, args.float8, env, dims)
    model = built.model
    if args.fuse_casts:
        fuse_weight_casts()
    result: dict = {"float8_linears": sorted(clean_name(n) for n, m in model.named_modules()
                                             if type(m).__name__ == "Float8Linear")}
    # The run's checkpoints go to <save>/run/checkpoints (Checkpointer's layout).
    config = Config(model=model_cfg)
    config.precision.float8, config.checkpoint.keep_last = args.float8, 1
    config.train.output_dir, config.train.run_name = args.save or ".", "run"
    ckpt = Checkpointer(config, load_tokenizer(model_cfg), env)
    if args.resume:
        ckpt.restore(Path(args.resume), model, None, optimizer, scheduler, global_batch=8, total_steps=10)
        result["loaded"] = full_params(model)
    else:
        load_weights(model, initial_weights(model_cfg, 0, model), env.device)
        result["loaded"] = full_params(model)
    precompute_scales_after_each_step(optimizer, model, args.float8)  # as train.py does, after the load
    samples = synthetic_global_batch(8)
    per_rank = len(samples) // env.world_size
    batch = collate(samples[env.rank * per_rank:(env.rank + 1) * per_rank], 0, 4096)
    losses = []
    for _ in range(args.steps):
        ce_sum, supervised = forward_backward(built, [batch], env.device)
        losses.append(all_reduce_sum([ce_sum.item()], env.device).item() / supervised.item())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    result["losses"] = losses
    result["trained"] = full_params(model)
    result["shard_dtypes"] = sorted({str(p.to_local().dtype) for p in model.parameters()})
    result["weight_types"] = sorted({type(p.to_local()).__name__ for p in model.parameters()})
    moments = [v.to_local() for s in optimizer.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")]
    result["moment_types"] = sorted({f"{type(m).__name__} {m.dtype}" for m in moments})
    if args.save:
        state = {"tokens_seen": 0, "global_batch": len(samples), "world_size": env.world_size}
        path = ckpt.save(args.steps, model, optimizer, scheduler, state)
        result["checkpoint"] = str(path)
        if args.reload_as:
            other, other_optimizer, other_scheduler = build(model_cfg, args.reload_as, env, dims)
            ckpt.restore(path, other.model, None, other_optimizer, other_scheduler, global_batch=8, total_steps=10)
            result["reloaded"] = full_params(other.model)
            # The same weights through both precisions: float8 must change the numbers, a little.
            result["loss_saved"] = loss_at_current_weights(built, batch, env)
            result["loss_reloaded"] = loss_at_current_weights(other, batch, env)
    if env.rank == 0:
        torch.save(result, args.out)
    dist.barrier()  # no rank tears down gloo while another still talks to it
    dist.destroy_process_group()


if __name__ == "__main__":
    run_command(main)
