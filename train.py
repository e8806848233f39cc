"""Full-parameter supervised fine-tuning of a Hugging Face causal LM with FSDP2.

    python train.py --config configs/demo.yaml                    # one process (CPU or one GPU)
    torchrun --nproc_per_node 8 train.py --config configs/qwen7b.yaml optim.lr=2e-5
    sbatch slurm/train.slurm configs/qwen72b.yaml                 # many nodes

The recipe, top to bottom: config -> distributed init -> data -> model on the meta device ->
activation checkpointing -> per-block compile -> FSDP2 -> materialise + load weights ->
optimizer -> training loop with held-out eval. The machinery lives in sft/, one concern a module.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from sft.checkpoint import (REQUEUE_EXIT_CODE, CheckpointError, load_checkpoint, load_prepared_model, prepare_run_dir,
                            save_checkpoint, save_prepared_model)
from sft.config import ConfigError, check_machine, parse_args, to_yaml
from sft.data import DataError, MicroBatches, StepSampler, load_sft_data, pack_best_fit
from sft.distributed import all_reduce_sum, init_distributed, log0
from sft.evaluate import evaluate
from sft.export import export_hf
from sft.loss import attach_sft_loss, forward_backward
from sft.metrics import (PEAK_BF16_FLOPS, MetricsLogger, flops_per_token, host_peak_rss_gib, peak_memory_gib,
                         seconds_since_process_start)
from sft.model import (ModelError, build_meta_model, decoder_blocks, initial_weights, load_tokenizer, load_weights,
                       materialize, real_buffers)
from sft.optim import build_optimizer, build_scheduler
from sft.parallel import build_mesh, parallelize
from sft.plan import GIB, apply_auto_plan, check_fits
from sft.preemption import StopRequest
from sft.profiling import StepProfiler


def main(argv: list[str] | None = None) -> None:
    # Config first: a typo fails here, before any process group, model or directory exists.
    cfg = parse_args(argv)
    env = init_distributed()
    check_machine(cfg, env.device)
    random.seed(cfg.train.seed)
    np.random.seed(cfg.train.seed)
    torch.manual_seed(cfg.train.seed)

    gpu_mem_gib = cfg.plan.gpu_mem_gib or (torch.cuda.get_device_properties(env.device).total_memory / GIB
                                           if env.device.type == "cuda" else None)
    if cfg.plan.auto and gpu_mem_gib:  # before the run directory, so config.yaml records the choice
        log0(apply_auto_plan(cfg, env.world_size, gpu_mem_gib))
    run_dir, ckpt_root = cfg.run_dir, cfg.run_dir / "checkpoints"
    resume_from = prepare_run_dir(cfg, env)

    # Data before the model: bad data fails fast, before the expensive part.
    tokenizer = load_tokenizer(cfg.model)
    train_data, eval_data = load_sft_data(cfg.data, tokenizer, cfg.train.seed)
    # With packing the sampler draws whole packed rows (lists of samples) instead of samples.
    packed_rows = pack_best_fit(train_data["length"], cfg.data.max_seq_len) if cfg.data.packing else None
    sampler = StepSampler(len(packed_rows) if packed_rows else len(train_data), cfg.train.micro_batch_size,
                          cfg.train.grad_accum_steps, env.rank, env.world_size, cfg.train.seed)
    if sampler.steps_per_epoch == 0:
        raise ConfigError(f"{sampler.num_samples} training {'rows' if packed_rows else 'samples'} < one global "
                          f"batch of {sampler.global_batch}; lower train.micro_batch_size or train.grad_accum_steps")
    total_steps = cfg.train.max_steps or cfg.train.epochs * sampler.steps_per_epoch
    log0(f"data: {len(train_data)} train / {len(eval_data) if eval_data else 0} eval samples"
         + (f", packed into {len(packed_rows)} rows of {cfg.data.max_seq_len}" if packed_rows else "")
         + f", global batch {sampler.global_batch}, {total_steps} steps")

    train_batch = MicroBatches(train_data, tokenizer.pad_token_id, cfg.data, packed_rows)
    eval_batch = MicroBatches(eval_data, tokenizer.pad_token_id, cfg.data) if eval_data is not None else None

    # Model: built on meta, wrapped in the fixed order AC -> compile -> FSDP, then materialised
    # shard by shard, so no rank ever holds the full weights.
    model = build_meta_model(cfg.model)
    if gpu_mem_gib:  # before anything is allocated: would this run fit?
        warning = check_fits(model, cfg, env.world_size, gpu_mem_gib)
        if warning:
            log0(warning)
    buffers = real_buffers(model)
    mesh = build_mesh(env.device.type, env.world_size, cfg.fsdp.replicate_degree)
    parallelize(model, decoder_blocks(model), mesh, cfg.ac.ratio, cfg.compile.enabled, cfg.fsdp)
    # Initial weights come from the run's checkpoint when resuming, else from the prepared-model
    # cache if there is one, else from the Hugging Face files (or the random init).
    materialize(model, buffers, env.device, offload=cfg.fsdp.cpu_offload)
    prepared = Path(cfg.model.prepared_cache) if cfg.model.prepared_cache else None
    if resume_from is None and not (prepared and load_prepared_model(prepared, model)):
        load_weights(model, initial_weights(cfg.model, cfg.train.seed), env.device)
        if prepared:
            save_prepared_model(prepared, model, env)
            log0(f"wrote the prepared-model cache {prepared}")
    elif resume_from is None:
        log0(f"loaded the prepared-model cache {prepared}")
    attach_sft_loss(model)
    model.train()
    num_params = sum(p.numel() for p in model.parameters())
    rss = torch.zeros(env.world_size)
    rss[env.rank] = host_peak_rss_gib()
    rss = all_reduce_sum(rss, env.device).tolist()  # every rank's peak host memory, to show loading is sharded
    log0(f"model: {type(model).__name__}, {num_params / 1e6:.1f}M parameters, init={cfg.model.init}; "
         f"host peak RSS per rank after loading: {', '.join(f'{x:.1f}' for x in rss)} GiB")

    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, total_steps)

    start_step, tokens_seen = 0, 0
    if resume_from is not None:
        t0 = time.perf_counter()
        state = load_checkpoint(resume_from, model, optimizer, scheduler, env)
        start_step, tokens_seen = state["step"], state["tokens_seen"]
        log0(f"resumed from {resume_from} (step {start_step}, saved by {state['world_size']} ranks) "
             f"in {time.perf_counter() - t0:.1f} s")
        if state["global_batch"] != sampler.global_batch:
            log0(f"warning: global batch {sampler.global_batch} != {state['global_batch']} of the checkpoint; "
                 "the data order from here differs from the original run's")
    stop = StopRequest()
    logger = MetricsLogger(run_dir, cfg.logging, cfg.train.run_name, dataclasses.asdict(cfg), total_steps,
                           start_step, enabled=env.is_main)

    def run_eval(step: int) -> float | None:
        if eval_data is None:
            return None
        loss = evaluate(model, eval_batch, cfg.train.micro_batch_size, env)
        logger.log({"step": step, "eval_loss": loss})
        return loss

    startup_s = seconds_since_process_start()
    log0(f"start-up took {startup_s:.1f} s (process start -> ready to train)")
    def save(step: int) -> Path | None:
        if not cfg.checkpoint.enabled:
            return None
        state = {"step": step, "tokens_seen": tokens_seen, "global_batch": sampler.global_batch,
                 "world_size": env.world_size}
        t0 = time.perf_counter()
        path = save_checkpoint(ckpt_root, step, model, optimizer, scheduler, state, to_yaml(cfg), tokenizer,
                               cfg.checkpoint.keep_last, env)
        logger.message(f"saved {path} in {time.perf_counter() - t0:.1f} s")
        return path

    first_eval = last_eval = run_eval(start_step)
    profiler = StepProfiler(cfg.logging.profile_steps, total_steps, run_dir / "profile", enabled=env.is_main)
    step_times: list[float] = []
    text_config = model.config.get_text_config()
    for step in range(start_step + 1, total_steps + 1):
        t0 = time.perf_counter()
        profiler.step_begins(step)
        micro_batches, token_counts = zip(*(train_batch(i) for i in sampler.micro_batches(step - 1)))
        ce_sum, supervised = forward_backward(model, micro_batches, env.device, cfg.fsdp.sync_grads_each_microbatch)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.clip_grad_norm or float("inf"))
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        flops = sum(n * flops_per_token(num_params, text_config.num_hidden_layers, text_config.hidden_size,
                                        b["input_ids"].shape[1]) for n, b in zip(token_counts, micro_batches))
        # One all-reduce for the metrics and the stop flag (every rank learns of a SIGTERM at the
        # same step), and the step's only wait for the GPU: reading the results.
        host_values = torch.tensor([sum(token_counts), flops, float(stop.requested)], dtype=torch.float64)
        totals = all_reduce_sum(torch.cat([ce_sum.double().view(1), host_values.to(env.device)]), env.device)
        ce_total, tokens, flops, stops, supervised, grad_norm = torch.cat(
            [totals, supervised.view(1), grad_norm.double().view(1)]).tolist()
        step_time = time.perf_counter() - t0
        profile_summary = profiler.step_ends(step)
        step_times.append(step_time)
        tokens_seen += int(tokens)
        entry = {"step": step, "loss": ce_total / supervised, "grad_norm": grad_norm, "lr": lr,
                 "tokens": int(tokens), "supervised_tokens": int(supervised), "tokens_seen": tokens_seen,
                 "step_time": step_time, "eta_s": (total_steps - step) * statistics.median(step_times[-20:]),
                 "tokens_per_s_per_gpu": tokens / step_time / env.world_size,
                 "supervised_tokens_per_s_per_gpu": supervised / step_time / env.world_size,
                 "peak_memory_gib": peak_memory_gib(env.device)}
        if env.device.type == "cuda":
            entry["mfu"] = flops / step_time / env.world_size / PEAK_BF16_FLOPS
        if step == 1:
            entry.update(startup_s=startup_s, host_peak_rss_gib_per_rank=rss)
        logger.log(entry)
        if profile_summary:
            logger.message(f"profile of steps {cfg.logging.profile_steps} in {run_dir / 'profile'}:\n{profile_summary}")
        if stops:
            save(step)
            logger.close()
            log0(f"stopping at step {step} on {stop.signal_name or 'another rank’s signal'}; "
                 f"exit code {REQUEUE_EXIT_CODE} asks for a requeue")
            dist.barrier()
            dist.destroy_process_group()
            sys.exit(REQUEUE_EXIT_CODE)
        if cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0 and step != total_steps:
            save(step)
        if cfg.eval.every_steps and step % cfg.eval.every_steps == 0 and step != total_steps:
            last_eval = run_eval(step)
    if eval_data is not None:
        last_eval = run_eval(total_steps)
        log0(f"eval loss {first_eval:.4f} -> {last_eval:.4f} ({1 - last_eval / first_eval:.0%} lower)")
    final = save(total_steps) if start_step < total_steps else resume_from
    logger.close()
    if env.is_main:
        if cfg.checkpoint.export_hf:
            t0 = time.perf_counter()
            export_hf(final, run_dir / "export", cfg.checkpoint.export_dtype)
            log0(f"exported a Hugging Face model to {run_dir / 'export'} in {time.perf_counter() - t0:.1f} s")
        (run_dir / "finished").touch()
    dist.barrier()  # no rank tears down gloo/NCCL while another still talks to it
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except (ConfigError, DataError, ModelError, CheckpointError) as e:
        # Bad input: one clear message, no traceback, non-zero exit so the scheduler sees it.
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
