"""Op-level activation checkpointing in process: what a block recomputes, and what a compiled block keeps
(the bytes the planner counts). The gradients of every mode against no checkpointing: the
distributed tables (tests/integration/test_distributed.py, AC_EQUAL_TO_NONE)."""

from collections import Counter

import pytest
import torch

from helpers import DEMO_MODEL, OpCounter
from sft.config import ACConfig, ModelConfig
from sft.models.architecture import decoder_blocks
from sft.models.build import build_meta_model
from sft.parallel.activation_checkpointing import apply_ac
from sft.parallel.activation_checkpointing import kept_bytes_per_token
from sft.plan import Shapes


def _demo_model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(DEMO_MODEL), attn_implementation="sdpa")
    model.config.use_cache = False  # as sft/models/ sets it for training
    return model.to(dtype)


def _backward_ops(ac: ACConfig) -> Counter:
    """The ops the demo model's backward runs (recomputation included) with every block under `ac`."""
    model = _demo_model()
    apply_ac(model, decoder_blocks(model), ac)
    ids = torch.randint(0, 500, (2, 16))
    with OpCounter() as counter:
        loss = model(input_ids=ids, labels=ids).loss
        forward = Counter(counter.counts)
        loss.backward()
    return counter.counts - forward


# What each mode recomputes per checkpointed block (eager), beyond the backward of an unchecked one:
# (mode, matmuls, attention kernels, SiLUs). Whole blocks rerun q, k, v, o, gate and up (checkpoint
# stops before down, whose output backward never reads); ops reruns no matmul and no attention;
# ops_half reruns k, o and up; attention reruns what whole blocks do but attention.
RECOMPUTED_PER_BLOCK = [("blocks", 6, 1, 1), ("ops", 0, 0, 1), ("ops_half", 3, 0, 1), ("attention", 6, 0, 1)]


@pytest.mark.parametrize("mode, matmuls, attention, silu", RECOMPUTED_PER_BLOCK,
                         ids=[row[0] for row in RECOMPUTED_PER_BLOCK])
def test_op_level_checkpointing_recomputes_only_the_cheap_ops(mode, matmuls, attention, silu):
    plain, ac = _backward_ops(ACConfig(0.0)), _backward_ops(ACConfig(1.0, mode))
    blocks = 4
    assert ac["mm"] + ac["addmm"] - plain["mm"] - plain["addmm"] == blocks * matmuls
    assert ac["_scaled_dot_product_flash_attention_for_cpu"] == blocks * attention
    assert ac["silu"] - plain["silu"] == blocks * silu


@pytest.mark.parametrize("mode, per_token", [("ops", 2832), ("ops_half", 1680), ("attention", 528)])
def test_compiled_op_level_block_keeps_what_the_planner_counts(mode, per_token):
    """The bytes per token a compiled checkpointed block hands from forward to backward (the
    partitioner's choice under the policy; bf16, log-sum-exp float32) are the planner's count."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition  # inductor's

    torch._dynamo.reset()
    model = _demo_model(torch.bfloat16)
    blocks = apply_ac(model, decoder_blocks(model), ACConfig(1.0, mode))
    forward_graphs = []

    def keep_forward(graph, _inputs):
        forward_graphs.append(graph)
        return make_boxed_func(graph)

    blocks[0].compile(backend=aot_autograd(fw_compiler=keep_forward, partition_fn=min_cut_rematerialization_partition,
                                           bw_compiler=lambda graph, _inputs: make_boxed_func(graph)))
    batch, seq = 2, 64
    ids = torch.randint(0, 500, (batch, seq))
    model(input_ids=ids, labels=ids).loss.backward()
    output = next(n for n in forward_graphs[0].graph.nodes if n.op == "output")
    # The forward's outputs after the block's own: what backward reads. Of the graph's inputs only the
    # hidden states count per token (weights and the shared rotary tables do not).
    saved = [n.meta["val"] for n in output.args[0][1:] if isinstance(n, torch.fx.Node)
             and (n.op != "placeholder" or tuple(n.meta["val"].shape[:2]) == (batch, seq))]
    kept = sum(t.numel() * t.element_size() for t in saved) / (batch * seq)
    shapes = Shapes.of(build_meta_model(ModelConfig(name_or_path=str(DEMO_MODEL))))
    assert kept == kept_bytes_per_token(shapes, compiled=True, mode=mode) == per_token
