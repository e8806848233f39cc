"""Supervised fine-tuning of a Hugging Face causal LM with FSDP2.

    python train.py --config configs/demo.yaml                    # one process (CPU or one GPU)
    torchrun --nproc_per_node 8 train.py --config configs/qwen7b.yaml optim.lr=2e-5
    sbatch slurm/train.slurm configs/qwen72b.yaml                 # many nodes

The recipe, top to bottom: config -> distributed init and the device mesh -> run directory (locked)
and resume point -> data -> the model (sft/training/model.py: on the meta device, causal SDPA where
rows are one sequence, MoE blocks ours, LoRA adapters, the master dtype -> parallelize: context
parallelism, expert parallelism, float8, activation checkpointing, per-block compile, FSDP2 ->
materialise) -> optimizer -> restore weights -> training loop with held-out eval -> the one
shutdown path (final or stop save, export). The machinery lives in sft/, one concern a module (README: Architecture).
"""

from __future__ import annotations

# First, before the seconds of importing torch: it notes the torchrun that started this worker,
# whose death it watches for (sft/training/preemption.py).
from sft.training.preemption import REQUEUE_EXIT_CODE, STOP_REQUEST, StopRequest, write_stopped_marker  # isort: skip

import dataclasses
import time
from pathlib import Path

from sft import rng
from sft.checkpoint.manager import Checkpointer
from sft.compile_cache import use_compile_cache
from sft.config import check_machine, parse_args
from sft.data.batches import MicroBatches, TrainBatches
from sft.data.images import holds_images, image_tokens
from sft.data.prepare import load_sft_data
from sft.distributed import init_distributed, log0, rank0_first, shut_down, smallest_over_ranks
from sft.errors import run_command
from sft.hub.tokenizer import check_vocabulary, load_tokenizer
from sft.parallel.float8 import precompute_scales_after_each_step
from sft.parallel.mesh import ParallelDims
from sft.plan import apply_auto_plan, check_fits, explain_out_of_memory, gpu_memory_gib, this_machine_mem_gib
from sft.profiling import StepProfiler
from sft.training.evaluate import Evaluations
from sft.training.loss import forward_backward
from sft.training.metrics import (MetricsLogger, StartupClock, StepMetrics, host_peak_rss_per_rank,
                                  seconds_since_process_start)
from sft.training.model import build_training_model
from sft.training.optim import build_optimizer, build_scheduler, clip_grad_norm
from sft.training.rundir import RunDirectory


def main(argv: list[str] | None = None) -> int:
    startup = StartupClock()  # where the start goes: imports, setup, data, model, weights (logged at step 1)
    # Config first: a typo fails here, before any process group, model or directory exists.
    cfg = parse_args(argv)
    # From here a SIGTERM/SIGUSR1 or a stop-request file stops the run within two steps, and the
    # death of the launcher ends it at once until training starts (sft/training/preemption.py).
    stop = StopRequest(cfg.run_dir / STOP_REQUEST, started_at=time.time() - seconds_since_process_start())
    env = init_distributed(cfg.fsdp.cpu_offload, cfg.dist.timeout_minutes)
    check_machine(cfg, env.device)
    # Before anything compiles: kernels an earlier process compiled (a requeue, a run of these shapes) load from here.
    log0(rank0_first(lambda: use_compile_cache(cfg.compile.cache_dir)))
    rng.seed(cfg.train.seed)  # python, numpy and torch
    gpu_mem_gib = gpu_memory_gib(cfg, env.device)
    if cfg.plan.auto and gpu_mem_gib:  # before anything is saved, so config.yaml records the choice
        # every rank plans for the job's smallest GPU and host, so that all of them choose alike
        gpu_mem_gib, host_mem_gib = smallest_over_ranks([gpu_mem_gib, this_machine_mem_gib()], env.device)
        log0(rank0_first(lambda: apply_auto_plan(cfg, env.world_size, gpu_mem_gib, host_mem_gib)))
    # One named mesh for every axis: FSDP, context and expert parallelism, the data-parallel ranks.
    dims = ParallelDims.of(cfg, env.world_size, env.rank).build(env.device.type)
    # The run directory is locked and checked, but nothing in it changes until everything below
    # has loaded: a run that fails to start leaves the previous one exactly as it was.
    run = RunDirectory(cfg, env)
    run.open()
    # Rank 0 reads the inputs first: a bad one is one error, reported once (rank0_first).
    tokenizer = rank0_first(lambda: load_tokenizer(cfg.model))
    rank0_first(lambda: check_vocabulary(cfg.model, tokenizer))
    ckpt = Checkpointer(cfg, tokenizer, env)
    resume_from = ckpt.resume_point(auto=run.resume_auto())
    startup.done("setup")

    # Data before the model: bad data fails fast, before the expensive part. A vision-language model
    # whose images train here takes image parts (its image processor; None: image rows are dropped).
    images = rank0_first(lambda: image_tokens(cfg.model, tokenizer))
    train_data, eval_data = load_sft_data(cfg.data, tokenizer, cfg.train.seed, images)
    global_batch = dims.global_batch(cfg.train.micro_batch_size, cfg.train.grad_accum_steps)
    train_batches = TrainBatches(train_data, tokenizer.pad_token_id, cfg.data, cfg.train.micro_batch_size,
                                 cfg.train.grad_accum_steps, global_batch, dims.dp_rank, cfg.train.seed)
    eval_batches = MicroBatches(eval_data, tokenizer.pad_token_id, cfg.data) if eval_data is not None else None
    total_steps = cfg.train.max_steps or cfg.train.epochs * train_batches.sampler.steps_per_epoch
    log0(f"data: {train_batches.describe()}, {len(eval_data) if eval_data else 0} eval samples, {total_steps} steps")
    startup.done("data")

    if gpu_mem_gib and (warning := check_fits(cfg, env.world_size, gpu_mem_gib)):
        log0(warning)  # before anything is allocated: this run may not fit
    if gpu_mem_gib:
        explain_out_of_memory(cfg, env.world_size, gpu_mem_gib)  # an OOM anywhere: one line, what fits
    # The model: built on meta in the fixed order, parallelized, materialised (sft/training/model.py).
    built = build_training_model(cfg, dims, env.device, images if holds_images(train_data, eval_data) else None)
    model, moe = built.model, built.moe
    optimizer = build_optimizer(model, cfg.optim, cfg.train.seed, compiled=cfg.compile.enabled)
    scheduler = build_scheduler(optimizer, cfg.optim, total_steps)
    startup.done("model")
    # The one place that decides where the weights come from: the resume checkpoint (with the
    # optimizer and scheduler), the prepared-model cache, the Hugging Face files or random init.
    state, loaded = ckpt.restore(resume_from, model, built.lora, optimizer, scheduler, global_batch, total_steps)
    # Only now: restoring the optimizer runs a step (of lr 0) on the weights before they load.
    precompute_scales_after_each_step(optimizer, model, cfg.precision.float8, built.lora)  # float8 all-gathers
    if moe:  # DeepSeek-V3-style routers: the correction bias follows each step's expert loads
        moe.update_biases_after_each_step(optimizer)
    startup.done("weights")
    rss = host_peak_rss_per_rank(env)
    architecture = type(model).__name__.removeprefix("FSDP")  # FSDP2 names the class it wraps the model in FSDP<class>
    log0(f"{loaded}; {architecture}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters; "
         f"host peak RSS per rank: {', '.join(f'{x:.1f}' for x in rss)} GiB")

    start_step = state["step"]
    run.start(start_step, ckpt.skipped)  # everything loaded: only now does this run change its directory
    logger = MetricsLogger(cfg.run_dir, cfg.logging, cfg.train.run_name, dataclasses.asdict(cfg), total_steps,
                           start_step, enabled=env.is_main)
    metrics = StepMetrics(model, env, total_steps, state["tokens_seen"], rss, dims, moe, startup)
    profiler = StepProfiler(cfg.logging.profile_steps, total_steps, cfg.run_dir / "profile", env.is_main,
                            report=logger.message)

    # A resumed run keeps the eval loss of the run's start.
    evals = Evaluations(built, eval_batches, cfg.train.micro_batch_size, cfg.eval.every_steps, total_steps, env,
                        dims, metrics, logger, first=state.get("first_eval_loss"))

    def save(step: int, blocking: bool = True) -> Path | None:
        metrics.pause()
        return ckpt.save(step, model, optimizer, scheduler, {
            "tokens_seen": metrics.tokens_seen, "global_batch": global_batch, "world_size": env.world_size,
            "first_eval_loss": evals.first}, blocking)

    evals.begin(start_step)
    step, stopped = start_step, False
    stop.training_begins()
    for step in range(start_step + 1, total_steps + 1):
        metrics.step_begins()
        profiler.step_begins(step)
        micro_batches = train_batches.step(step)
        ce_sum, supervised = forward_backward(built, [b for b, _ in micro_batches], env.device,
                                              cfg.fsdp.sync_grads_each_microbatch, dims)
        grad_norm = clip_grad_norm(model, cfg.optim.clip_grad_norm)
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        metrics.step_ends(step, micro_batches, ce_sum, supervised, grad_norm, lr, stop.requested)
        save_now = bool(cfg.checkpoint.every_steps) and step % cfg.checkpoint.every_steps == 0 and step != total_steps
        eval_now = evals.due(step) and step != total_steps  # the last step's: on the shutdown path
        # A step's numbers are read once the next step's work is queued, but where they are needed now.
        stopped = metrics.log_ended(logger, now=save_now or eval_now or step == total_steps)
        profiler.step_ends(step)
        ckpt.step_done(model, optimizer, stopped)  # commits a background save; after step 1: staging buffers
        if stopped:
            break
        if save_now:
            save(step, blocking=False)
        if eval_now:
            evals.at(step)

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
        evals.end()
        final = save(total_steps) if start_step < total_steps else resume_from
        exit_code = 0
    logger.close()
    ckpt.close()
    shut_down()
    # Rank 0 exports after the process group is gone: no other rank waits for it under a
    # collective timeout (a 72B export writes ~145 GB).
    if env.is_main and not stopped:
        run.finish(final)
    return exit_code


if __name__ == "__main__":
    run_command(main)
