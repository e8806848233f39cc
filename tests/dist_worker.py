"""Run under torchrun by the distributed tests: one optimizer step on a fixed global batch, for
each of several runs in one launch (starting Python, torch and gloo costs more than a run).

    torchrun --nproc_per_node N tests/dist_worker.py --runs RUNS.json --out DIR

RUNS.json maps a run's name to its flags (parse_run below); rank 0 writes {"loss", "grads", ...} of
each to DIR/<name>.pt. With --reference a run instead uses the plain Hugging Face model (no FSDP,
one process) on the whole global batch with HF's own loss.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from safetensors import safe_open

from helpers import synthetic_global_batch
from sft.collate import collate, collate_packed
from sft.config import ACConfig, FSDPConfig, ModelConfig, OptimConfig
from sft.context_parallel import ContextParallel
from sft.distributed import all_reduce_sum, init_distributed
from sft.loss import attach_sft_loss, forward_backward, loss_inputs
from sft.model import (build_meta_model, clean_name, decoder_blocks, initial_weights, load_weights, materialize,
                       real_buffers)
from sft.optim import build_optimizer
from sft.parallel import build_mesh, parallelize


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().float().cpu()


def reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5" resets the peak RSS (VmHWM) to the current RSS
        f.write("5")


def peak_rss_gib() -> float:
    line = next(x for x in open("/proc/self/status") if x.startswith("VmHWM:"))
    return int(line.split()[1]) / 2**20


def compare_with_checkpoint(model: torch.nn.Module, directory: str) -> list[str]:
    """Names of parameters whose gathered value differs from the checkpoint file's tensor."""
    files = {}
    for path in Path(directory).glob("*.safetensors"):
        with safe_open(path, framework="pt") as f:
            files.update({k: f.get_tensor(k) for k in f.keys()})
    return [n for n, p in model.named_parameters() if not torch.equal(full(p), files[clean_name(n)].float())]


def parse_run(flags: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--param-dtype", default="float32")
    p.add_argument("--ac-ratio", type=float, default=0.0)
    p.add_argument("--ac-mode", default="blocks")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--float8", default="none", help="precision.float8 (emulated float8 matmuls on CPU)")
    p.add_argument("--replicate", type=int, default=1, help="HSDP replicate degree")
    p.add_argument("--reduce-dtype", default="float32")
    p.add_argument("--zero2", action="store_true", help="fsdp.reshard_after_forward=false")
    p.add_argument("--deferred-sync", action="store_true", help="fsdp.sync_grads_each_microbatch=false")
    p.add_argument("--cp", type=int, default=1, help="cp.degree")
    p.add_argument("--packed", action="store_true", help="each micro-batch's samples packed into one row")
    p.add_argument("--leakage-probe", action="store_true",
                   help="instead of a step: the loss of a packed row's last document as earlier ones change")
    p.add_argument("--reference", action="store_true")
    p.add_argument("--load", help="init from this HF checkpoint dir and compare every tensor with the file")
    return p.parse_args(flags)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", required=True)
    p.add_argument("--out", required=True)
    launch = p.parse_args()
    env = init_distributed()
    for name, flags in json.loads(Path(launch.runs).read_text()).items():
        torch._dynamo.reset()  # each compiled run compiles its own graphs, as in a process of its own
        result = run(parse_run(flags), env)
        if env.rank == 0:
            torch.save(result, Path(launch.out) / f"{name}.pt")
    dist.barrier()  # no rank tears down gloo/NCCL while another still talks to it
    dist.destroy_process_group()


def run(args: argparse.Namespace, env) -> dict:
    torch.manual_seed(0)
    samples = synthetic_global_batch(args.global_batch)
    model_cfg = ModelConfig(name_or_path=args.load or args.model, init="pretrained" if args.load else "random")
    model = build_meta_model(model_cfg)
    buffers = real_buffers(model)
    result: dict = {}

    if args.reference:
        materialize(model, buffers, env.device)
        load_weights(model, initial_weights(model_cfg, 0, model), env.device)
        batch = collate(samples, pad_token_id=0, max_seq_len=4096)
        loss = model(**batch).loss
        loss.backward()
        result["loss"] = loss.item()
        result["supervised_tokens"] = (batch["labels"][:, 1:] != -100).sum().item()
        named = dict(model.named_parameters())
    else:
        mesh = build_mesh(env.device.type, env.world_size, args.replicate)
        cp = ContextParallel.build(args.cp, env)
        parallelize(model, decoder_blocks(model), mesh, ACConfig(args.ac_ratio, args.ac_mode), args.compile,
                    FSDPConfig(param_dtype=args.param_dtype, reduce_dtype=args.reduce_dtype,
                               reshard_after_forward=not args.zero2, replicate_degree=args.replicate), args.float8, cp)
        reset_peak_rss()
        rss_before = peak_rss_gib()
        materialize(model, buffers, env.device)
        load_weights(model, initial_weights(model_cfg, 0, model), env.device)
        rss = torch.zeros(env.world_size)
        rss[env.rank] = peak_rss_gib() - rss_before
        result["load_rss_increase_gib"] = all_reduce_sum(rss, env.device).tolist()
        if args.load:
            result["load_mismatches"] = compare_with_checkpoint(model, args.load)
            result["tied_after_load"] = model.get_output_embeddings().weight is model.get_input_embeddings().weight
        attach_sft_loss(model)
        if args.leakage_probe:
            return leakage_probe(model, cp, env)
        block_linear = next(m for m in decoder_blocks(model)[0].modules() if isinstance(m, torch.nn.Linear))

        def record_weight_dtype(module: torch.nn.Module, _inputs) -> None:
            result.setdefault("forward_weight_dtype", str(module.weight.dtype))

        block_linear.register_forward_pre_hook(record_weight_dtype)
        per_rank = args.global_batch // cp.dp_size  # the ranks of a cp group share their samples
        mine = samples[cp.dp_rank * per_rank : (cp.dp_rank + 1) * per_rank]
        micro = per_rank // args.grad_accum
        groups = [mine[i : i + micro] for i in range(0, per_rank, micro)]
        batches = [collate_packed([g], 0, sum(len(s["input_ids"]) for s in g)) if args.packed else collate(g, 0, 4096)
                   for g in groups]
        ce_sum, num_tokens = forward_backward(model, batches, env.device, not args.deferred_sync, cp)
        result["supervised_tokens"] = num_tokens.item()
        result["loss"] = all_reduce_sum([ce_sum.item()], env.device)[0].item() / num_tokens.item()
        named = dict(model.named_parameters())
        result["shard_dtypes"] = sorted({str(p.to_local().dtype) for p in named.values()})
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
        result["grad_norm"] = full(norm).item()
        optimizer = build_optimizer(model, OptimConfig(lr=1e-3))
        optimizer.step()
        result["moment_dtypes"] = sorted({str(v.to_local().dtype) for s in optimizer.state.values()
                                          for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")})
        head, embed = model.get_output_embeddings().weight, model.get_input_embeddings().weight
        result["tied_after_step"] = head is embed

    result["grads"] = {clean_name(n): full(p.grad) for n, p in named.items()}
    return result


def leakage_probe(model: torch.nn.Module, cp: ContextParallel, env) -> dict:
    """The summed loss of the last document of one packed row (three documents, only the last one
    supervised) as it is, with the tokens of the first two replaced, and with its own first token
    replaced (the control: the probe sees a change where there is one)."""
    def last_document_loss(first: list[int], second: list[int], last: list[int]) -> float:
        row = [{"input_ids": ids, "labels": [-100] * len(ids)} for ids in (first, second)]
        row.append({"input_ids": last, "labels": [-100] + last[1:]})
        batch = collate_packed([row], 0, sum(len(s["input_ids"]) for s in row))
        with torch.no_grad():
            ce = model.sft_loss(**{k: v.to(env.device) for k, v in loss_inputs(batch, cp).items()})
        return all_reduce_sum([ce.item()], env.device)[0].item()

    g = torch.Generator().manual_seed(1)
    first, second, last, other_first, other_second = (torch.randint(3, 800, (n,), generator=g).tolist()
                                                      for n in (13, 22, 17, 13, 22))
    base = last_document_loss(first, second, last)
    return {"base": base, "earlier_changed": last_document_loss(other_first, other_second, last),
            "own_changed": last_document_loss(first, second, [(last[0] + 1) % 800, *last[1:]])}


if __name__ == "__main__":
    main()
