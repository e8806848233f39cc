"""Full-parameter supervised fine-tuning of a Hugging Face causal LM with FSDP2.

    python train.py --config configs/demo.yaml                    # one process (CPU or one GPU)
    torchrun --nproc_per_node 8 train.py --config configs/qwen7b.yaml optim.lr=2e-5
    sbatch slurm/train.slurm configs/qwen72b.yaml                 # many nodes

The recipe, top to bottom: config -> distributed init -> run directory (locked) and resume point ->
data -> model on the meta device -> float8 -> activation checkpointing -> per-block compile ->
FSDP2 -> materialise -> optimizer -> restore weights -> training loop with held-out eval -> the one
shutdown path (final or stop save, export). The machinery lives in sft/, one concern a module.
"""

from __future__ import annotations

# First, before the seconds of importing torch: it notes the torchrun that started this worker,
# whose death it watches for (sft/preemption.py).
from sft.training.preemption import REQUEUE_EXIT_CODE, STOP_REQUEST, StopRequest, write_stopped_marker# isort: skip

import dataclasses
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from sft.checkpoint.manager import Checkpointer
from sft.config import check_machine, parse_args
from sft.errors import run_command
from sft.parallel.context_parallel import ContextParallel
from sft.data.batches import TrainBatches, MicroBatches
from sft.data.prepare import load_sft_data
from sft.distributed import init_distributed, log0, rank0_first
from sft.training.evaluate import evaluate
from sft.export import export_hf
from sft.models.float8 import precompute_float8_scales
from sft.training.loss import attach_sft_loss, forward_backward
from sft.training.metrics import MetricsLogger, StepMetrics, host_peak_rss_per_rank, seconds_since_process_start
from sft.models.build import build_meta_model, decoder_blocks, load_tokenizer, materialize, real_buffers
from sft.models.moe import apply_moe
from sft.training.optim import build_optimizer, build_scheduler, clip_grad_norm
from sft.parallel.fsdp import build_mesh
from sft.parallel.parallelize import parallelize
from sft.plan import GIB, apply_auto_plan, check_fits
from sft.profiling import StepProfiler
from sft.training.rundir import RunDirectory


def main(argv: list[str] | None = None) -> int:
    # Config first: a typo fails here, before any process group, model or directory exists.
    cfg = parse_args(argv)
    # From here a SIGTERM/SIGUSR1 or a stop-request file stops the run after its next step, and the
    # death of the launcher ends it at once until training starts (sft/preemption.py).
    stop = StopRequest(cfg.run_dir / STOP_REQUEST, started_at=time.time() - seconds_since_process_start())
    env = init_distributed(cfg.fsdp.cpu_offload, cfg.dist.timeout_minutes)
    check_machine(cfg, env.device)
    random.seed(cfg.train.seed)
    np.random.seed(cfg.train.seed)
    torch.manual_seed(cfg.train.seed)

    gpu_mem_gib = cfg.plan.gpu_mem_gib or (torch.cuda.get_device_properties(env.device).total_memory / GIB
                                           if env.device.type == "cuda" else None)
    if cfg.plan.auto and gpu_mem_gib:  # before anything is saved, so config.yaml records the choice
        log0(rank0_first(lambda: apply_auto_plan(cfg, env.world_size, gpu_mem_gib)))
    cp = ContextParallel.build(cfg.cp.degree, env)  # the data-parallel ranks are the cp groups
    # The run directory is locked and checked, but nothing in it changes until everything below
    # has loaded: a run that fails to start leaves the previous one exactly as it was.
    run = RunDirectory(cfg, env)
    run.open()
    # Rank 0 reads the inputs first: a bad one is one error, reported once (rank0_first).
    tokenizer = rank0_first(lambda: load_tokenizer(cfg.model))
    ckpt = Checkpointer(cfg, tokenizer, env)
    resume_from = ckpt.resume_point(auto=run.resume_auto())

    # Data before the model: bad data fails fast, before the expensive part.
    train_data, eval_data = load_sft_data(cfg.data, tokenizer, cfg.train.seed)
    train_batches = TrainBatches(train_data, tokenizer.pad_token_id, cfg.data, cfg.train.micro_batch_size,
                                 cfg.train.grad_accum_steps, cp.dp_rank, cp.dp_size, cfg.train.seed)
    eval_batches = MicroBatches(eval_data, tokenizer.pad_token_id, cfg.data) if eval_data is not None else None
    total_steps = cfg.train.max_steps or cfg.train.epochs * train_batches.sampler.steps_per_epoch
    log0(f"data: {train_batches.describe()}, {len(eval_data) if eval_data else 0} eval samples, {total_steps} steps")

    # Model: built on meta, wrapped in the fixed order float8 -> AC -> compile -> FSDP, then
    # materialised shard by shard, so no rank ever holds the full weights.
    model = rank0_first(lambda: build_meta_model(cfg.model))
    apply_moe(model, cfg.moe)  # MoE models: our routing, experts and load-balancing loss (sft/moe.py)
    if gpu_mem_gib:  # before anything is allocated: would this run fit?
        warning = check_fits(model, cfg, env.world_size, gpu_mem_gib)
        if warning:
            log0(warning)
    ckpt.check_room(model, resume_from, total_steps)
    buffers = real_buffers(model)
    mesh = build_mesh(env.device.type, env.world_size, cfg.fsdp.replicate_degree)
    parallelize(model, decoder_blocks(model), mesh, cfg.ac, cfg.compile.enabled, cfg.fsdp, cfg.precision.float8, cp)
    materialize(model, buffers, env.device, offload=cfg.fsdp.cpu_offload)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, total_steps)
    # The one place that decides where the weights come from: the resume checkpoint (with the
    # optimizer and scheduler), the prepared-model cache, the Hugging Face files or random init.
    t0 = time.perf_counter()
    state, loaded = ckpt.restore(resume_from, model, optimizer, scheduler)
    attach_sft_loss(model)
    model.train()
    rss = host_peak_rss_per_rank(env)
    log0(f"{loaded} in {time.perf_counter() - t0:.1f} s; {type(model).__name__}, "
         f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters; "
         f"host peak RSS per rank: {', '.join(f'{x:.1f}' for x in rss)} GiB")
    if state.get("global_batch", train_batches.sampler.global_batch) != train_batches.sampler.global_batch:
        log0(f"warning: global batch {train_batches.sampler.global_batch} != {state['global_batch']} of the "
             "checkpoint; the data order from here differs from the original run's")

    start_step = state["step"]
    run.start(start_step, ckpt.skipped)  # everything loaded: only now does this run change its directory
    logger = MetricsLogger(cfg.run_dir, cfg.logging, cfg.train.run_name, dataclasses.asdict(cfg), total_steps,
                           start_step, enabled=env.is_main)
    startup_s = seconds_since_process_start()
    log0(f"start-up took {startup_s:.1f} s (process start -> ready to train)")
    metrics = StepMetrics(model, env, total_steps, state["tokens_seen"],
                          first_step_extras={"startup_s": startup_s, "host_peak_rss_gib_per_rank": rss},
                          cp_degree=cp.degree)
    profiler = StepProfiler(cfg.logging.profile_steps, total_steps, cfg.run_dir / "profile", env.is_main,
                            report=logger.message)

    def run_eval(step: int) -> float | None:
        if eval_batches is None:
            return None
        loss = evaluate(model, eval_batches, cfg.train.micro_batch_size, env, cp)
        logger.log({"step": step, "eval_loss": loss})
        return loss

    def save(step: int, blocking: bool = True) -> Path | None:
        if not cfg.checkpoint.enabled:
            return None
        t0 = time.perf_counter()
        path = ckpt.save(step, model, optimizer, scheduler, {
            "tokens_seen": metrics.tokens_seen, "global_batch": train_batches.sampler.global_batch,
            "world_size": env.world_size, "first_eval_loss": first_eval}, blocking)
        logger.message(f"saved {path} in {time.perf_counter() - t0:.1f} s"
                       + ("" if blocking or not cfg.checkpoint.async_save else " (training blocked; writing on)"))
        return path

    # A resumed run keeps the eval loss of the run's start (no extra full eval per resume).
    first_eval = state["first_eval_loss"] if "first_eval_loss" in state else run_eval(start_step)
    step, stopped = start_step, False
    for step in range(start_step + 1, total_steps + 1):
        metrics.step_begins()
        profiler.step_begins(step)
        micro_batches = train_batches.step(step)
        ce_sum, supervised = forward_backward(model, [b for b, _ in micro_batches], env.device,
                                              cfg.fsdp.sync_grads_each_microbatch, cp)
        grad_norm = clip_grad_norm(model, cfg.optim.clip_grad_norm)
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        precompute_float8_scales(model, cfg.precision.float8)  # tensorwise: next step's float8 all-gather
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        entry, stopped = metrics.step_ends(step, micro_batches, ce_sum, supervised, grad_norm, lr, stop.requested)
        logger.log(entry)
        profiler.step_ends(step)
        ckpt.poll()  # commits a background save once every rank has written it
        if stopped:
            break
        if step == start_step + 1:
            ckpt.prepare_staging(model, optimizer)  # host buffers for asynchronous saves, in the background
        if cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0 and step != total_steps:
            save(step, blocking=False)
        if cfg.eval.every_steps and step % cfg.eval.every_steps == 0 and step != total_steps:
            run_eval(step)

    # The one shutdown path, for a finished run and for a stop on SIGTERM/SIGUSR1.
    # Every path saves synchronously, which first commits a background save still in flight.
    if stopped:
        saved = save(step) is not None
        if saved and env.is_main:  # the marker a requeue trusts: only after a committed checkpoint
            write_stopped_marker(cfg.run_dir, step, stop.signal_name)
        log0(f"stopping at step {step} on {stop.signal_name or 'another rank’s request'} "
             + (f"with a committed checkpoint; exit code {REQUEUE_EXIT_CODE} asks for a requeue" if saved
                else "without a checkpoint (checkpoint.enabled=false): nothing to resume from"))
        exit_code = REQUEUE_EXIT_CODE if saved else 1
    else:
        last_eval = run_eval(total_steps)
        if last_eval is not None and first_eval is not None:
            log0(f"eval loss {first_eval:.4f} -> {last_eval:.4f} ({1 - last_eval / first_eval:.0%} lower)")
        final = save(total_steps) if start_step < total_steps else resume_from
        exit_code = 0
    logger.close()
    dist.barrier()  # no rank tears down gloo/NCCL while another still talks to it
    dist.destroy_process_group()
    # Rank 0 exports after the process group is gone: no other rank waits for it under a
    # collective timeout (a 72B export writes ~145 GB).
    if env.is_main and not stopped:
        if cfg.checkpoint.export_hf:
            t0 = time.perf_counter()
            export_hf(final, cfg.run_dir / "export", cfg.checkpoint.export_dtype)
            log0(f"exported a Hugging Face model to {cfg.run_dir / 'export'} in {time.perf_counter() - t0:.1f} s")
        run.finish()
    return exit_code


if __name__ == "__main__":
    run_command(main)
