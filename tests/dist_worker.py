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
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from helpers import synthetic_global_batch
from sft.data.collate import collate, collate_packed
from sft.config import (ACConfig, CompileConfig, Config, CPConfig, DataConfig, FSDPConfig, LoRAConfig, MoEConfig,
                        ModelConfig, OptimConfig, PrecisionConfig)
from sft.distributed import all_reduce_sum, init_distributed, local_part
from sft.errors import run_command
from sft.training.loss import forward_backward, loss_inputs, on_device
from sft.models.architecture import decoder_blocks
from sft.models.build import build_meta_model, clean_name, materialize, real_buffers
from sft.hub.weights import initial_weights, load_weights
from sft.models.nf4 import is_nf4
from sft.parallel.tiled_mlp import TiledMLP
from sft.hub.layout import is_adapter
from sft.training.model import build_training_model
from sft.training.optim import build_optimizer, clip_grad_norm
from sft.parallel.activation_checkpointing import _host_offloaded_block_class
from sft.parallel.mesh import ParallelDims


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().float().cpu()


def reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5" resets the peak RSS (VmHWM) to the current RSS
        f.write("5")


def peak_rss_gib() -> float:
    line = next(x for x in open("/proc/self/status") if x.startswith("VmHWM:"))
    return int(line.split()[1]) / 2**20


def compare_with_checkpoint(model: torch.nn.Module, directory: str) -> list[str]:
    """Names of parameters whose gathered value differs from what transformers' from_pretrained makes
    of the checkpoint (its files' tensors, converted where the published layout differs)."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).state_dict()
    return [n for n, p in model.named_parameters() if not torch.equal(full(p), reference[clean_name(n)])]


def parse_run(flags: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--param-dtype", default="float32")
    p.add_argument("--ac-ratio", type=float, default=0.0)
    p.add_argument("--ac-mode", default="blocks")
    p.add_argument("--ac-offload", action="store_true", help="ac.offload (host copies of what checkpointing keeps)")
    p.add_argument("--mlp-tile", type=int, default=0, help="ac.mlp_tile_tokens (tiled dense MLPs)")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--float8", default="none", help="precision.float8 (emulated float8 matmuls on CPU)")
    p.add_argument("--replicate", type=int, default=1, help="HSDP replicate degree")
    p.add_argument("--reduce-dtype", default="float32")
    p.add_argument("--zero2", action="store_true", help="fsdp.reshard_after_forward=false")
    p.add_argument("--deferred-sync", action="store_true", help="fsdp.sync_grads_each_microbatch=false")
    p.add_argument("--cp", type=int, default=1, help="cp.degree")
    p.add_argument("--ep", type=int, default=1, help="moe.ep_degree")
    p.add_argument("--packed", action="store_true", help="each micro-batch's samples packed into one row of 128")
    p.add_argument("--leakage-probe", action="store_true",
                   help="instead of a step: the loss of a packed row's last document as earlier ones change")
    p.add_argument("--empty-experts-probe", action="store_true",
                   help="instead of a step: expert parallelism with every row routed to rank 0's experts")
    p.add_argument("--save-state", help="after the step, save model and optimizer state with DCP to this dir")
    p.add_argument("--load-state", help="after the step, load model and optimizer state with DCP from this dir")
    p.add_argument("--reference", action="store_true")
    p.add_argument("--micro-batch", type=int, help="MoE reference: the micro-batches of the run it stands for")
    p.add_argument("--attn", default="sdpa", help="model.attn_implementation (gpt-oss: eager)")
    p.add_argument("--load", help="init from this HF checkpoint dir and compare every tensor with the file")
    p.add_argument("--lora-rank", type=int, default=0, help="lora.rank (adapters on every Linear of the blocks, "
                   "set to non-zero values: lora_B starts at zero, where the adapters' gradients tell little)")
    p.add_argument("--lora-base", default="bfloat16", help="lora.base (nf4: QLoRA)")
    p.add_argument("--lora-targets", default="all-linear", help="lora.target_modules, comma-separated (experts: "
                   "the routed experts too)")
    p.add_argument("--aux-coef", type=float, help="moe.aux_loss_coef (0: the loss is the cross-entropy alone, as "
                   "Hugging Face's model computes it without output_router_logits)")
    p.add_argument("--exact-casts", action="store_true", help="compiled code rounds to bf16 where eager does "
                   "(inductor's emulate_precision_casts): a compiled NF4 dequantisation equals the eager reference's")
    return p.parse_args(flags)


LORA_ALPHA = 16.0


def adapter_value(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A non-zero value for adapter parameter `name`, the same on every rank and in the reference."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode()))) * 0.05


def set_adapters(model: torch.nn.Module) -> None:
    """Every adapter parameter (sharded or not) set to adapter_value."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if is_adapter(name):
                full_value = adapter_value(clean_name(name), tuple(param.shape))
                if isinstance(param, DTensor):
                    chunk = param.__create_chunk_list__()[0]
                    index = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))
                    param.to_local().copy_(full_value[index])
                else:
                    param.copy_(full_value)


def nf4_round_trip(weight: torch.Tensor) -> torch.Tensor:
    """torchao's NF4 round trip of the bf16 weight (of its rows, for a fused expert weight), where it
    splits into NF4's groups of 64 x 256 values; else the weight."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    if weight.numel() % (64 * 256):
        return weight
    rows = weight.to(torch.bfloat16).reshape(-1, weight.shape[-1])
    return to_nf4(rows).get_original_weight().view(weight.shape).to(weight.dtype)


def lora_reference(model, samples: list[dict], rank: int, base: str, experts: bool = False) -> dict:
    """Hugging Face's model and loss, each target Linear's weight replaced by the merged W + s B A
    (torch.func.functional_call), with A and B leaves: the loss and the adapters' gradients by
    autograd through the merge, an independent computation of what LoRALinear does. base nf4: W is
    the NF4 round trip of the bf16 weight (nf4_round_trip).
    `experts`: each fused expert weight too, expert by expert (transposed where the model stores it
    so), through Hugging Face's own per-expert loop: what ExpertLoRA computes on grouped GEMMs."""
    merged, adapters = {}, {}
    for name, module in model.named_modules():
        if experts and isinstance(getattr(module, "gate_up_proj", None), torch.nn.Parameter):
            for weight_name in ("gate_up_proj", "down_proj"):
                weight = nf4_round_trip(getattr(module, weight_name).detach()) if base == "nf4" \
                    else getattr(module, weight_name).detach()  # [E, out, in], or [E, in, out] transposed
                num, rows, columns = weight.shape
                fan_in, fan_out = (rows, columns) if module.is_transposed else (columns, rows)
                a = adapter_value(f"{name}.{weight_name}_lora.lora_A", (num, rank, fan_in)).requires_grad_()
                b = adapter_value(f"{name}.{weight_name}_lora.lora_B", (num, fan_out, rank)).requires_grad_()
                adapters[f"{name}.{weight_name}_lora.lora_A"], adapters[f"{name}.{weight_name}_lora.lora_B"] = a, b
                delta = torch.stack([LORA_ALPHA / rank * b[e] @ a[e] for e in range(num)])
                merged[f"{name}.{weight_name}"] = weight + (delta.transpose(1, 2) if module.is_transposed else delta)
        if type(module) is torch.nn.Linear and ".layers." in name:
            a = adapter_value(f"{name}.lora_A.weight", (rank, module.in_features)).requires_grad_()
            b = adapter_value(f"{name}.lora_B.weight", (module.out_features, rank)).requires_grad_()
            adapters[f"{name}.lora_A.weight"], adapters[f"{name}.lora_B.weight"] = a, b
            weight = nf4_round_trip(module.weight.detach()) if base == "nf4" else module.weight.detach()
            merged[f"{name}.weight"] = weight + LORA_ALPHA / rank * b @ a
    batch = collate(samples, pad_token_id=0, max_seq_len=4096)
    loss = torch.func.functional_call(model, merged, kwargs={k: batch[k] for k in ("input_ids", "labels", "position_ids")},
                                      strict=False).loss
    loss.backward()
    return {"loss": loss.item(), "supervised_tokens": (batch["labels"][:, 1:] != -100).sum().item(),
            "grads": {name: t.grad for name, t in adapters.items()}}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", required=True)
    p.add_argument("--out", required=True)
    launch = p.parse_args()
    env = init_distributed()
    for name, flags in json.loads(Path(launch.runs).read_text()).items():
        torch._dynamo.reset()  # each compiled run compiles its own graphs, as in a process of its own
        # ... with dynamo's settings of a fresh process (sft.models.moe.apply_moe changes one for MoE models)
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = False
        args = parse_run(flags)
        torch._inductor.config.emulate_precision_casts = args.exact_casts
        result = run(args, env)
        if env.rank == 0:
            torch.save(result, Path(launch.out) / f"{name}.pt")
    dist.barrier()  # no rank tears down gloo/NCCL while another still talks to it
    dist.destroy_process_group()


def run(args: argparse.Namespace, env) -> dict:
    if args.empty_experts_probe:
        return empty_experts_probe(env)
    torch.manual_seed(0)
    samples = synthetic_global_batch(args.global_batch)
    model_cfg = ModelConfig(name_or_path=args.load or args.model, init="pretrained" if args.load else "random",
                            attn_implementation=args.attn)
    model = build_meta_model(model_cfg)
    buffers = real_buffers(model)
    result: dict = {}

    if args.reference and args.micro_batch:
        result.update(moe_reference(model, buffers, model_cfg, samples, args.micro_batch, env.device))
        named = dict(model.named_parameters())
    elif args.reference and args.lora_rank:
        materialize(model, buffers, env.device)
        load_weights(model, initial_weights(model_cfg, 0, model), env.device)
        experts = "experts" in args.lora_targets.split(",")
        if experts:
            model.set_experts_implementation("eager")  # Hugging Face's per-expert loop
        return lora_reference(model, samples, args.lora_rank, args.lora_base, experts)
    elif args.reference:
        materialize(model, buffers, env.device)
        load_weights(model, initial_weights(model_cfg, 0, model), env.device)
        batch = {k: v.to(env.device) for k, v in collate(samples, pad_token_id=0, max_seq_len=4096).items()}
        loss = model(input_ids=batch["input_ids"], labels=batch["labels"], position_ids=batch["position_ids"]).loss
        loss.backward()
        result["loss"] = loss.item()
        result["supervised_tokens"] = (batch["labels"][:, 1:] != -100).sum().item()
        named = dict(model.named_parameters())
    else:
        # The model as train.py builds it (sft/training/model.py), from the config these flags stand for.
        cfg = Config(model=model_cfg, data=DataConfig(packing=args.packed),
                     ac=ACConfig(args.ac_ratio, args.ac_mode, args.ac_offload, args.mlp_tile),
                     fsdp=FSDPConfig(param_dtype=args.param_dtype, reduce_dtype=args.reduce_dtype,
                                     reshard_after_forward=not args.zero2, replicate_degree=args.replicate),
                     compile=CompileConfig(enabled=args.compile), precision=PrecisionConfig(float8=args.float8),
                     cp=CPConfig(degree=args.cp), moe=MoEConfig(ep_degree=args.ep, aux_loss_coef=args.aux_coef),
                     lora=LoRAConfig(rank=args.lora_rank, alpha=LORA_ALPHA, base=args.lora_base,
                                     target_modules=args.lora_targets.split(",")))
        dims = ParallelDims.of(cfg, env.world_size, env.rank).build(env.device.type)
        reset_peak_rss()
        rss_before = peak_rss_gib()
        built = build_training_model(cfg, dims, env.device)
        model, moe = built.model, built.moe
        load_weights(model, initial_weights(model_cfg, 0, model), env.device)
        set_adapters(model)
        rss = torch.zeros(env.world_size)
        rss[env.rank] = peak_rss_gib() - rss_before
        result["load_rss_increase_gib"] = all_reduce_sum(rss, env.device).tolist()
        if args.load:
            result["load_mismatches"] = compare_with_checkpoint(model, args.load)
            result["tied_after_load"] = model.get_output_embeddings().weight is model.get_input_embeddings().weight
        if args.leakage_probe:
            return leakage_probe(built.loss, dims, env)
        block_linear = next(m for m in decoder_blocks(model)[0].modules() if isinstance(m, torch.nn.Linear))

        def record_weight_dtype(module: torch.nn.Module, _inputs) -> None:
            result.setdefault("forward_weight_dtype", str(module.weight.dtype))

        block_linear.register_forward_pre_hook(record_weight_dtype)
        per_rank = args.global_batch // dims.dp_size  # the ranks of a cp group share their samples
        mine = samples[dims.dp_rank * per_rank : (dims.dp_rank + 1) * per_rank]
        micro = per_rank // args.grad_accum
        groups = [mine[i : i + micro] for i in range(0, per_rank, micro)]
        batches = [collate_packed([g], 0, 128) if args.packed else collate(g, 0, 4096) for g in groups]
        ce_sum, num_tokens = forward_backward(built, batches, env.device, not args.deferred_sync, dims)
        result["supervised_tokens"] = num_tokens.item()
        result["loss"] = all_reduce_sum([ce_sum.item()], env.device)[0].item() / num_tokens.item()
        if moe:
            stats = all_reduce_sum(moe.step_stats(), env.device)
            result["aux_loss"] = moe.summary(stats)["aux_loss"]
        named = dict(model.named_parameters())
        result["host_offloaded_blocks"] = sum(isinstance(m, _host_offloaded_block_class()) for m in model.modules())
        result["tiled_mlps"] = sum(isinstance(m, TiledMLP) for m in model.modules())
        result["shard_dtypes"] = sorted({str(p.to_local().dtype) for p in named.values() if p.requires_grad})
        result["frozen_shard_dtypes"] = sorted({str(local_part(p).dtype) for p in named.values() if not p.requires_grad})
        result["nf4_weights"] = [clean_name(n) for n, p in named.items() if is_nf4(p)]
        result["frozen_with_grads"] = [n for n, p in named.items() if not p.requires_grad and p.grad is not None]
        result["expert_placements"] = sorted({f"{p.device_mesh.mesh_dim_names}: {p.placements}"
                                              for n, p in named.items() if ".experts." in n and p.dim() == 3})
        result["grad_norm"] = clip_grad_norm(model, None).item()
        optimizer = build_optimizer(model, OptimConfig(lr=1e-3))
        optimizer.step()
        result["moment_dtypes"] = sorted({str(v.to_local().dtype) for s in optimizer.state.values()
                                          for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")})
        result["optimizer_state_of_frozen"] = [n for n, p in named.items() if not p.requires_grad and p in optimizer.state]
        head, embed = model.get_output_embeddings().weight, model.get_input_embeddings().weight
        result["tied_after_step"] = head is embed
        if args.save_state or args.load_state:
            result["state"] = save_or_load_state(model, optimizer, args.save_state, args.load_state)

    result["grads"] = {clean_name(n): full(p.grad) for n, p in named.items() if p.grad is not None}
    return result


def moe_reference(model, buffers, model_cfg: ModelConfig, samples: list[dict], micro: int,
                  device: torch.device) -> dict:
    """One process, Hugging Face's own MoE model (its per-expert loop, its load_balancing_loss_func
    with the padding masked), on the micro-batches of `micro` samples of the run it stands for:
    sum of CE / supervised tokens + coef * mean over layers of each micro-batch's aux loss, weighted
    by its share of real tokens (the definition in sft/models/moe.py)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    model.set_experts_implementation("eager")
    materialize(model, buffers, device)
    load_weights(model, initial_weights(model_cfg, 0, model), device)
    config = model.config
    batches = [{k: v.to(device) for k, v in collate(samples[i : i + micro], 0, 4096).items()}
               for i in range(0, len(samples), micro)]
    supervised = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
    real = sum(int(b["real_tokens"].sum()) for b in batches)
    ce, aux = 0.0, 0.0
    for b in batches:
        out = model(input_ids=b["input_ids"], position_ids=b["position_ids"], output_router_logits=True)
        # its CE without its aux term (which forward adds to the loss over all tokens, padding included)
        ce = ce + model.loss_function(out.logits, b["labels"], config.vocab_size) * int(
            (b["labels"][:, 1:] != -100).sum()) / supervised
        layers = [load_balancing_loss_func((logits,), logits.shape[-1], config.num_experts_per_tok, b["real_tokens"])
                  for logits in out.router_logits]
        aux = aux + config.router_aux_loss_coef * sum(layers) / len(layers) * int(b["real_tokens"].sum()) / real
    (ce + aux).backward()
    return {"loss": ce.item(), "aux_loss": aux.item()}


def leakage_probe(loss, dims: ParallelDims, env) -> dict:
    """The summed loss of the last document of one packed row (three documents, only the last one
    supervised) as it is, with the tokens of the first two replaced, and with its own first token
    replaced (the control: the probe sees a change where there is one)."""
    def last_document_loss(first: list[int], second: list[int], last: list[int]) -> float:
        row = [{"input_ids": ids, "labels": [-100] * len(ids)} for ids in (first, second)]
        row.append({"input_ids": last, "labels": [-100] + last[1:]})
        batch = collate_packed([row], 0, sum(len(s["input_ids"]) for s in row))
        with torch.no_grad():
            ce = loss(**on_device(loss_inputs(batch, dims), env.device))
        return all_reduce_sum([ce.item()], env.device)[0].item()

    g = torch.Generator().manual_seed(1)
    first, second, last, other_first, other_second = (torch.randint(3, 800, (n,), generator=g).tolist()
                                                      for n in (13, 22, 17, 13, 22))
    base = last_document_loss(first, second, last)
    return {"base": base, "earlier_changed": last_document_loss(other_first, other_second, last),
            "own_changed": last_document_loss(first, second, [(last[0] + 1) % 800, *last[1:]])}


def save_or_load_state(model, optimizer, save: str | None, load: str | None) -> dict[str, torch.Tensor]:
    """Save the model's and optimizer's state to `save`, or load it from `load` (DCP, as the
    checkpoints do); return every tensor of it, gathered whole."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
    if save:
        dcp.save(state, checkpoint_id=save)
    else:
        with torch.no_grad():  # nothing of this run's own state may survive the load
            for tensor in [*state["model"].values(), *(v for values in state["optimizer"]["state"].values()
                                                      for v in values.values() if isinstance(v, torch.Tensor))]:
                local_part(tensor).zero_()
        assert not any(local_part(p).any() for p in model.parameters()), "the state dict is not the model's own tensors"
        dcp.load(state, checkpoint_id=load)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
        state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
    whole = {f"model.{k}": full(v) for k, v in state["model"].items()}
    for name, values in state["optimizer"]["state"].items():
        whole.update({f"optimizer.{name}.{k}": full(v) for k, v in values.items() if isinstance(v, torch.Tensor)})
    return whole


def empty_experts_probe(env) -> dict:
    """4 experts on 2 ep ranks; each rank's 12 rows all routed to experts 0 and 1 (rank 0's). The
    outputs and gradients across ranks against the whole experts run where the rows are (the
    gradients summed over the ranks' rows)."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from sft.models.experts import GroupedExperts, run_local_experts
    from sft.models.architecture import become
    from sft.parallel.expert_parallel import _shard_by_expert, run_experts_across_ranks

    def experts() -> GroupedExperts:
        torch.manual_seed(0)
        hf = Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=16, moe_intermediate_size=8, num_experts=4))
        for param in hf.parameters():
            torch.nn.init.normal_(param, std=0.2)
        become(hf, GroupedExperts)
        return hf

    generator = torch.Generator().manual_seed(env.rank)
    ids = torch.randint(0, 2, (12,), generator=generator).sort().values
    rows = torch.randn(12, 16, generator=generator)
    whole = experts()
    expected = run_local_experts(whole, rows, ids, 4)
    expected.square().sum().backward()
    mesh = init_device_mesh("cpu", (2,))
    spread = experts()
    _shard_by_expert(spread, mesh)
    received = torch.zeros(2)
    compute = spread.compute

    def counted(rows: torch.Tensor, *args) -> torch.Tensor:  # the rows that arrived at this rank's experts
        received[env.rank] += rows.shape[0]
        return compute(rows, *args)
    spread.compute = counted
    spread.ep_group = mesh.get_group()
    sent = run_experts_across_ranks(spread, rows, ids, 4)
    sent.square().sum().backward()
    result = {"max_output_error": all_reduce_sum([(sent - expected).abs().max().item()], env.device).item(),
              "received_rows": [int(x) for x in all_reduce_sum(received, env.device)]}
    grad_error, rank1_sum = 0.0, 0.0
    for name, param in spread.named_parameters():
        total = all_reduce_sum(whole.get_parameter(name).grad, env.device)  # every rank's rows
        mine = param.grad.to_local()
        grad_error = max(grad_error, (mine - total.chunk(2)[env.rank]).abs().max().item())
        rank1_sum += all_reduce_sum(mine.abs().sum() * (env.rank == 1), env.device).item()
    result["max_grad_error"] = all_reduce_sum(torch.tensor([grad_error]), env.device).item()
    result["rank1_grad_abs_sum"] = rank1_sum
    return result


if __name__ == "__main__":
    run_command(main)
