"""Mixture of experts end to end: the MoE demo (learns, resumes exactly, exports what transformers
reloads) and a compiled block's load-balancing gradient. In process: tests/unit/test_moe.py; the
2-rank comparisons with Hugging Face's eager MoE: tests/integration/test_distributed.py (MOE_RUNS)."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import gpt_oss_model_dir, hf_moe_model, run_demo, run_torchrun
from sft.config import MoEConfig
from sft.training.metrics import read_metrics
from sft.models.moe import apply_moe


@pytest.mark.slow
def test_moe_demo_learns_resumes_exactly_and_exports(tmp_path, demo_data):
    """train.py on configs/demo_moe.yaml, 2 ranks, expert parallel (moe.ep_degree=2): the loss falls;
    metrics.jsonl has the aux loss and each layer's expert load; a run resumed from step 3 repeats
    steps 4-6 exactly (loss, grad norm, aux loss); the export has one tensor per expert and reloads
    in transformers to the checkpoint's weights. (Its state loads bit for bit without expert
    parallelism: tests/integration/test_distributed.py.)"""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    def train(name: str, *overrides: str) -> None:
        run_torchrun(["train.py", "--config", "configs/demo_moe.yaml", f"data.path={demo_data / 'train.jsonl'}",
                      "data.eval_path=null", f"train.output_dir={tmp_path}", f"train.run_name={name}",
                      f"data.cache_dir={tmp_path / 'cache'}", "train.max_steps=6", "eval.every_steps=0",
                      *overrides], nproc=2)

    train("whole", "checkpoint.every_steps=3", "checkpoint.export_hf=true", "moe.ep_degree=2")
    train("resumed", f"checkpoint.resume={tmp_path / 'whole' / 'checkpoints' / 'step-3'}", "moe.ep_degree=2")
    whole, _ = read_metrics(tmp_path / "whole")
    resumed, _ = read_metrics(tmp_path / "resumed")

    assert whole[6]["loss"] < 0.9 * whole[1]["loss"]
    assert len(whole[1]["expert_load_cv"]) == len(whole[1]["dead_experts"]) == 4 and whole[1]["aux_loss"] > 0
    for step in (4, 5, 6):
        for key in ("loss", "grad_norm", "aux_loss", "expert_load_cv"):
            assert resumed[step][key] == whole[step][key], (step, key)

    export = tmp_path / "whole" / "export"
    keys = set(json.loads((export / "model.safetensors.index.json").read_text())["weight_map"])
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in keys
    assert not any(k.endswith(("experts.gate_up_proj", "experts.down_proj")) for k in keys)
    reloaded = AutoModelForCausalLM.from_pretrained(export).state_dict()
    trained = {name: torch.empty(t.shape) for name, t in reloaded.items() if name != "lm_head.weight"}  # tied
    dcp.load({"model": trained}, checkpoint_id=tmp_path / "whole" / "checkpoints" / "step-6", no_dist=True)
    for name, tensor in trained.items():
        assert torch.equal(reloaded[name], tensor), name


@pytest.mark.slow  # compiles (10-20 s each on a cold inductor cache)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32 fallback", "bf16 grouped"])
def test_compiled_block_keeps_the_load_balancing_gradient(dtype):
    """A compiled MoE block gives the router the same aux-loss gradient as the eager one: in bf16
    (grouped GEMM, one graph) and in float32 (the per-expert fallback breaks the graph)."""
    torch._dynamo.reset()
    model = hf_moe_model(num_hidden_layers=1).to(dtype)
    ids = torch.randint(0, 800, (2, 16))
    router_grads = {}
    for coef in (0.0, 1.0):
        for compiled in (False, True):
            model.zero_grad()
            router = apply_moe(model, MoEConfig(aux_loss_coef=coef))
            block = model.model.layers[0]
            block.compile() if compiled else setattr(block, "_compiled_call_impl", None)
            router.begin_step(torch.tensor(32.0))
            router.begin_micro_batch(torch.ones(2, 16, dtype=torch.bool))
            model(input_ids=ids, labels=ids).loss.backward()
            router_grads[coef, compiled] = block.mlp.gate.weight.grad.float().clone()
    aux_eager = router_grads[1.0, False] - router_grads[0.0, False]
    aux_compiled = router_grads[1.0, True] - router_grads[0.0, True]
    assert aux_eager.norm() > 0.1 * router_grads[0.0, False].norm()
    # a difference of two gradients: in bf16 each carries its own rounding, so compare norms
    assert (aux_compiled - aux_eager).norm() < (0.05 if dtype == torch.bfloat16 else 1e-4) * aux_eager.norm()


@pytest.mark.slow  # compiles
def test_a_checkpointed_block_compiles_whole_under_expert_parallelism():
    """Expert parallelism's dispatch is one op in checkpointed blocks (sft/parallel/expert_parallel.py):
    a compiled block, checkpointed, holds it without a graph break (a break sent the whole block to
    eager: half the speed on GPUs), three blocks share one graph (nothing of a block's own is a
    constant of it), and the loss and gradients equal the eager model's without expert parallelism
    (here over a group of one rank; 2 and 4 ranks: tests/integration/test_distributed.py)."""
    import copy
    from types import SimpleNamespace

    import torch.distributed as dist
    from torch._dynamo.utils import counters
    from torch.distributed.device_mesh import init_device_mesh

    from sft.config import ACConfig
    from sft.distributed import local_part
    from sft.parallel.activation_checkpointing import apply_ac
    from sft.parallel.expert_parallel import apply_expert_parallel
    from zoo import _one_rank

    _one_rank()
    try:
        torch._dynamo.reset()
        counters.clear()
        model = hf_moe_model(num_hidden_layers=3)
        ids = torch.randint(0, 800, (2, 16))
        results = []
        for spread in (False, True):
            run = copy.deepcopy(model)
            moe = apply_moe(run, MoEConfig(aux_loss_coef=1.0))
            if spread:
                apply_expert_parallel(moe, SimpleNamespace(ep_mesh=init_device_mesh("cpu", (1,)), ep=1),
                                      checkpointed=set(run.modules()))
                for block in apply_ac(run, list(run.model.layers), ACConfig(ratio=1.0), always_kept=moe.kept_ops):
                    block.compile()
            moe.begin_step(torch.tensor(32.0))
            moe.begin_micro_batch(torch.ones(2, 16, dtype=torch.bool))
            loss = run(input_ids=ids, labels=ids).loss
            loss.backward()
            results.append((loss.item(), {n.replace("_checkpoint_wrapped_module.", ""): local_part(p.grad)
                                          for n, p in run.named_parameters()}))
        assert dict(counters["graph_break"]) == {} and counters["stats"]["unique_graphs"] == 1  # one for 3 blocks
        (eager_loss, eager_grads), (loss, grads) = results
        assert loss == pytest.approx(eager_loss, rel=1e-6)
        assert eager_grads.keys() == grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, eager_grads[name], rtol=1e-5, atol=1e-6, msg=name)
    finally:
        dist.destroy_process_group()


def test_gpt_oss_trains_and_exports_with_the_default_attention(tmp_path, demo_data):
    """gpt-oss has no SDPA (its attention sinks): with the default model.attn_implementation the run
    says once that it uses eager on this CPU, trains, and its export (built without attention of
    this machine's) loads back in transformers as gpt-oss."""
    from transformers import AutoModelForCausalLM

    proc = run_demo(demo_data, tmp_path, "gpt_oss", f"model.name_or_path={gpt_oss_model_dir(tmp_path)}",
                    "model.init=random", "train.max_steps=2", "eval.every_steps=0", "checkpoint.export_hf=true")
    said = [line for line in proc.stdout.splitlines() if "attention: GptOssForCausalLM" in line]
    assert len(said) == 1 and said[0].endswith("cannot run model.attn_implementation=sdpa here; using eager "
                                               "(model.attn_implementation chooses)"), proc.stdout[-2000:]
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path / "gpt_oss" / "export")).__name__ == "GptOssForCausalLM"

