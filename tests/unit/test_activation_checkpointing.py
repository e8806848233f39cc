"""Op-level activation checkpointing in process: what a block recomputes, what a compiled block keeps
(the bytes the planner counts), and what ac.offload moves to host memory. The gradients of every mode
against no checkpointing: the distributed tables (tests/integration/test_distributed.py, AC_EQUAL_TO_NONE)."""

import functools
from collections import Counter

import pytest
import torch

from helpers import DEMO_MODEL, OpCounter
from sft.config import AC_MODES, ACConfig, ModelConfig
from sft.models.architecture import decoder_blocks
from sft.models.build import build_meta_model, clean_name
from sft.parallel.activation_checkpointing import _HostOffload, apply_ac, apply_host_offload, kept_bytes_per_token
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


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_offloaded_blocks_keep_their_inputs_in_host_memory(monkeypatch, compiled):
    """ac.offload: each checkpointed block's input (hidden states) goes to host memory and comes back
    for its recomputation, and nothing else does (compiled: not the weights nor the rotary tables the
    partitioner saves too); the gradients are those of blocks that keep their inputs on the device,
    bit for bit; the parameter names do not change."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition  # inductor's

    moved: list[torch.Tensor] = []
    to_host = _HostOffload._to_host

    def counted(self, tensor):
        packed = to_host(self, tensor)
        if isinstance(packed, tuple):
            moved.append(tensor)
        return packed

    monkeypatch.setattr(_HostOffload, "_to_host", counted)
    batch, seq = 2, 16
    ids = torch.randint(0, 500, (batch, seq), generator=torch.Generator().manual_seed(0))
    grads = {}
    for offload in (False, True):
        torch._dynamo.reset()
        model = _demo_model()
        names = list(model.state_dict())
        blocks = apply_ac(model, decoder_blocks(model), ACConfig(1.0, "blocks"))
        if compiled:  # the partitioner's choice without inductor's code generation (fast on a CPU)
            boxed = aot_autograd(fw_compiler=lambda graph, _: make_boxed_func(graph),
                                 bw_compiler=lambda graph, _: make_boxed_func(graph),
                                 partition_fn=min_cut_rematerialization_partition)
            for block in blocks:
                block.compile(backend=boxed)
        if offload:
            apply_host_offload(model, blocks)
            assert list(model.state_dict()) == names
        moved.clear()
        model(input_ids=ids, labels=ids).loss.backward()
        grads[offload] = {clean_name(name): param.grad for name, param in model.named_parameters()}
    assert [tuple(t.shape) for t in moved] == [(batch, seq, model.config.hidden_size)] * model.config.num_hidden_layers
    for name, grad in grads[False].items():
        assert torch.equal(grad, grads[True][name]), name


def test_offload_refuses_a_block_whose_input_it_cannot_move():
    """Eager checkpointing keeps keyword arguments out of autograd's hooks: a block called with its
    hidden states by keyword would keep them on the device while the planner counts them as moved."""
    from sft.config import ConfigError

    model = _demo_model()
    blocks = apply_host_offload(model, apply_ac(model, decoder_blocks(model), ACConfig(1.0, "blocks")))
    hidden = torch.randn(1, 4, model.config.hidden_size, requires_grad=True)
    rotary = model.model.rotary_emb(hidden, torch.arange(4)[None])
    with pytest.raises(ConfigError, match=r"ac.offload: .*DecoderLayer's input was not saved .*set ac.offload=false"):
        blocks[0](hidden_states=hidden, position_embeddings=rotary, attention_mask=None)


def _kept(shapes: list, tensor: torch.Tensor) -> torch.Tensor:
    shapes.append(tensor.shape)
    return tensor


@pytest.mark.parametrize("lora_rank", [0, 4], ids=["full", "lora"])
def test_a_tiled_mlp_gives_the_mlps_outputs_and_gradients_and_keeps_only_its_input(lora_rank):
    """ac.mlp_tile_tokens: an MLP run 8 tokens of a row at a time (rows of 21: an uneven last tile)
    gives the untiled MLP's output, input gradient and weight (or adapter) gradients, and keeps for
    backward nothing but its input; a row no longer than a tile takes the MLP's own forward."""
    import copy

    from sft.adapters.lora import apply_lora
    from sft.config import LoRAConfig
    from sft.parallel.tiled_mlp import apply_mlp_tiling

    model = _demo_model()
    if lora_rank:
        apply_lora(model, decoder_blocks(model), LoRAConfig(rank=lora_rank), torch.float32)
        for name, param in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.02)  # B starts at zero: its A's gradient would be zero too
    tiled = copy.deepcopy(model)
    apply_mlp_tiling(decoder_blocks(tiled), 8)
    x, probe = torch.randn(2, 21, model.config.hidden_size), torch.randn(2, 21, model.config.hidden_size)
    results = []
    for m in (model, tiled):
        mlp = decoder_blocks(m)[0].mlp
        inp = x.clone().requires_grad_(True)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(functools.partial(_kept, saved), lambda t: t):
            out = mlp(inp)
        (out * probe).sum().backward()
        results.append((out, inp.grad, {n: p.grad for n, p in mlp.named_parameters() if p.requires_grad}, saved))
    (out, grad, weights, _), (tiled_out, tiled_grad, tiled_weights, tiled_saved) = results
    torch.testing.assert_close(tiled_out, out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(tiled_grad, grad, rtol=1e-5, atol=1e-6)
    assert weights.keys() == tiled_weights.keys() and len(weights) == (6 if lora_rank else 3)
    for name in weights:
        torch.testing.assert_close(tiled_weights[name], weights[name], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")
    assert tiled_saved == [x.shape]  # the input alone, where the untiled MLP keeps gate, up and their product
    short, saved = x[:, :8].clone().requires_grad_(True), []
    with torch.autograd.graph.saved_tensors_hooks(functools.partial(_kept, saved), lambda t: t):
        decoder_blocks(tiled)[0].mlp(short)
    assert len(saved) > 1  # the MLP's own forward


def test_a_tiled_mlp_with_dropout_reruns_its_tiles_with_the_forwards_masks():
    """GPT-2's MLP drops out its output (resid_pdrop): the tiles' rerun in backward draws the masks the
    forward drew, so the gradients are those of the forward that ran (each tile through plain autograd
    from the same random state), not of other masks."""
    from helpers import tiny_config
    from transformers import AutoModelForCausalLM

    from sft.parallel.tiled_mlp import apply_mlp_tiling

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("gpt2", resid_pdrop=0.5))
    mlp = decoder_blocks(model)[0].mlp
    x, probe = torch.randn(2, 20, model.config.hidden_size), torch.randn(2, 20, model.config.hidden_size)
    apply_mlp_tiling(decoder_blocks(model), 8)
    grads = []
    for tiled in (False, True):
        torch.manual_seed(1)
        inp = x.clone().requires_grad_(True)
        out = mlp(inp) if tiled else torch.cat([mlp.untiled_forward(part.contiguous())
                                                for part in inp.split(8, dim=1)], dim=1)
        (out * probe).sum().backward()
        grads.append((out.detach(), inp.grad, {n: p.grad.clone() for n, p in mlp.named_parameters()}))
        mlp.zero_grad()
    (ref_out, ref_x, ref_w), (out, grad_x, grad_w) = grads
    torch.testing.assert_close(out, ref_out)  # the same masks in the forward
    assert (out == 0).float().mean() > 0.3  # dropout at work
    torch.testing.assert_close(grad_x, ref_x, rtol=1e-5, atol=1e-6)
    for name in ref_w:
        torch.testing.assert_close(grad_w[name], ref_w[name], rtol=1e-5, atol=1e-6)


def test_mlp_tiling_refuses_an_mlp_that_takes_more_than_the_hidden_states():
    from helpers import tiny_config
    from transformers import AutoModelForCausalLM

    from sft.config import ConfigError
    from sft.parallel.tiled_mlp import apply_mlp_tiling

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config("bloom"))
    with pytest.raises(ConfigError, match=r"^ac.mlp_tile_tokens=8: BloomMLP takes hidden_states, residual, not the "):
        apply_mlp_tiling(decoder_blocks(model), 8)
    assert not Shapes.of(model).mlp_tileable  # nor does plan.auto tile it


def test_selective_checkpointing_keeps_nothing_run_without_gradients():
    """A tiled MLP's forward runs its tiles without gradients inside a checkpointed block: an op-level
    mode must not keep their matmuls' outputs, which nothing reads (its backward reruns the tiles)."""
    from torch.utils.checkpoint import CheckpointPolicy

    from sft.parallel.activation_checkpointing import _selective_context

    forward_context, _ = _selective_context(AC_MODES["ops"], frozenset(), frozenset())
    policy = forward_context.policy_fn
    a, b = torch.ones(2, 2), torch.ones(2, 2)
    ctx = type("Ctx", (), {"is_recompute": False})()
    assert policy(ctx, torch.ops.aten.mm.default, a, b) == CheckpointPolicy.MUST_SAVE
    with torch.no_grad():
        assert policy(ctx, torch.ops.aten.mm.default, a, b) == CheckpointPolicy.PREFER_RECOMPUTE


def test_mlp_tiling_refuses_blocks_without_a_dense_mlp():
    from helpers import tiny_config
    from transformers import AutoModelForCausalLM

    from sft.config import ConfigError
    from sft.parallel.tiled_mlp import apply_mlp_tiling

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe"))
    with pytest.raises(ConfigError, match=r"^ac.mlp_tile_tokens=8: the decoder blocks have no dense MLP \("):
        apply_mlp_tiling(decoder_blocks(model), 8)
