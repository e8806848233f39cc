"""The memory model: the predicted per-GPU peak of a setting (the host's: sft/plan/host.py).

Peak = the larger of two moments; what is allocated and freed within a block or micro-batch
(gathered blocks, activations, loss buffers, unsharded gradients) gets 5% allocator slack, the
sharded state (weights, moments, gradients: the same large tensors every step) none. End of forward:
fp32 params and both Adam moments (12 bytes per parameter over the shard group; gradients are None
between steps, so +4 from the second micro-batch of a step on), the gathered blocks in
fsdp.param_dtype (current + prefetched, or with ZeRO-2 every block until its backward; the root's
embeddings and lm_head), activations (a checkpointed block keeps only its input, the others
everything backward needs, plus one block being recomputed) and the loss buffers (one chunk of fp32
logits and its gradient, the fp32 lm_head gradient formed in forward). End of backward: all 16 bytes
per parameter of sharded state, the gathered blocks, one block's unsharded gradients (fp32, or bf16
with fsdp.reduce_dtype=bfloat16) and one block's activations.
The state's bytes per parameter: sft/config/state_bytes.py. How activations, mixture-of-experts
blocks, Gated DeltaNet hybrids, float8, op-level checkpointing, LoRA/QLoRA and fsdp.cpu_offload are
counted, and which measured peaks each was fitted on or checked against: docs/training.md, "The
memory model"; docs/BENCHMARKS.md "Memory planner" compares the predictions with measured peaks.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
from torch import nn

from sft.adapters.lora import apply_lora, nf4_weights
from sft.config import DTYPES, LOGITS_PER_CHUNK, STATE_BYTES, Config, LoRAConfig, StateBytes, state_bytes
from sft.models.architecture import decoder_blocks, text_config
from sft.models.layers import recurrent_byte_blocks
from sft.models.moe import active_parameters, eager_expert_widths, expert_shape
from sft.models.nf4 import NF4_BYTES_PER_PARAMETER, NF4_EAGER_DEQUANT_BYTES
from sft.models.packing import cp_unsupported
from sft.parallel.activation_checkpointing import ac_block_indices, kept_bytes_per_token
from sft.parallel.mesh import ParallelDims
from sft.parallel.tiled_mlp import tiling_refusal

GIB = 2**30
ALLOCATOR_SLACK = 1.05
DEFAULT_GPUS_PER_NODE = 8
# A prediction fits a GPU when it is within this fraction of its memory: the rest is for the CUDA
# context, NCCL and cuBLAS buffers and allocator fragmentation. A 14B offload run predicted at 93%
# of a 140 GiB H200 ran out of memory with 1.5 GiB outside PyTorch and 10.5 GiB reserved but
# unallocated (docs/BENCHMARKS.md).
USABLE_FRACTION = 0.9
# Under expert parallelism the rows each rank's experts receive change every step, and so do the
# sizes of what a block keeps of them; kept across blocks (blocks without checkpointing, or the
# matmul outputs op-level checkpointing keeps) they leave holes the allocator cannot reuse. Measured
# on 140 GiB H200s (docs/BENCHMARKS.md, issue #36): 13-19 GiB reserved but unallocated so (gpt-oss-20b
# ran out of memory at 120 GiB allocated, predicted 124-125), 5 GiB (Qwen3-30B-A3B) and 13 GiB
# (gpt-oss-20b, which ran) with every block checkpointed whole or at attention.
ROUTED_USABLE_FRACTION = 0.8


def usable_fraction(s: Shapes, cfg: Config, ac_ratio: float, ac_mode: str) -> float:
    """The fraction of a GPU's memory a prediction may take under this setting (see above)."""
    keeps_routed = s.experts and cfg.moe.ep_degree > 1 and (ac_ratio < 1 or ac_mode in ("ops", "ops_half"))
    return ROUTED_USABLE_FRACTION if keeps_routed else USABLE_FRACTION


def predict_fit(s: Shapes, cfg: Config, m: Machine, micro_batch: int, ac_ratio: float,
                ac_mode: str) -> tuple[float, bool]:
    """A setting's predicted peak GiB per GPU, and whether it fits the GPUs (usable_fraction)."""
    gib = predict_gib(s, cfg, m.gpus, micro_batch, ac_ratio, ac_mode)
    return gib, m.fits(gib, usable_fraction(s, cfg, ac_ratio, ac_mode))


@dataclass(frozen=True)
class Shapes:
    params: int
    block_params: int
    root_params: int
    layers: int
    hidden: int
    ffn: int
    kv_dim: int
    heads: int
    vocab: int
    param_shapes: tuple[tuple[int, ...], ...]  # each parameter once (a tied one once)
    # Mixture of experts (0 for dense models): experts per block, experts per token; `ffn` is then
    # the FFN width a token runs through (top_k x the expert's intermediate size).
    experts: int = 0
    top_k: int = 0
    active_params: int = 0
    block_experts: int = 0  # the expert weights of one block (of block_params)
    eager_expert_widths: int = 0  # what eager experts keep per routed row (sft/models/moe.py:eager_expert_widths)
    context_parallel: bool = True  # whether rows can be split (sft/parallel/context_parallel.py:unsupported)
    attention_dim: int = 0  # heads x head_dim: q and attention's output (0: hidden, as in Llama/Qwen2.5)
    gated_attention: bool = False  # q_proj also makes a gate for attention's output (Qwen3.5, Qwen3-Next)
    # Gated DeltaNet hybrids (Qwen3.5, Qwen3-Next): which blocks are Gated DeltaNet (0-based), their value
    # width (linear_num_value_heads x linear_value_head_dim)
    delta_blocks: tuple[int, ...] = ()
    delta_value_dim: int = 0
    # LoRA (sft/adapters/lora.py): the parameters that train (all, without it), those of one block,
    # whether the lm_head trains; QLoRA: the base weights stored in NF4 (in all, in one block: whole
    # on every rank) and the largest of them (dequantised to bf16 one matrix at a time).
    trained_params: int | None = None
    block_trained: int | None = None
    block_trained_experts: int | None = None  # of block_trained: the routed experts' (their adapters)
    head_trained: bool = True
    root_trained: int | None = None  # of root_params (embeddings, final norm, lm_head): those that train
    mlp_tileable: bool = False  # dense MLPs ac.mlp_tile_tokens can tile (sft/parallel/tiled_mlp.py)
    nf4_params: int = 0
    block_nf4: int = 0
    largest_nf4: int = 0

    @property
    def q_dim(self) -> int:
        return self.attention_dim or self.hidden

    @property
    def trained(self) -> int:
        return self.params if self.trained_params is None else self.trained_params

    @property
    def block_trained_params(self) -> int:
        return self.block_params if self.block_trained is None else self.block_trained

    @property
    def block_trained_expert_params(self) -> int:
        return self.block_experts if self.block_trained_experts is None else self.block_trained_experts

    @classmethod
    def of(cls, model: nn.Module, lora: LoRAConfig | None = None) -> Shapes:
        """The shapes of `model` (a meta-device model), trained as `lora` says (on it: it is changed)."""
        if lora is not None and lora.enabled:
            apply_lora(model, decoder_blocks(model), dataclasses.replace(lora, base="bfloat16"), torch.bfloat16)
            nf4 = [p.numel() for p in nf4_weights(model)] if lora.base == "nf4" else []
            largest = _largest_block(model)
            block_nf4 = nf4_weights(largest) if nf4 else []
            return dataclasses.replace(
                cls.of(model), trained_params=sum(p.numel() for p in model.parameters() if p.requires_grad),
                block_trained=sum(p.numel() for p in largest.parameters() if p.requires_grad),
                block_trained_experts=sum(p.numel() for n, p in largest.named_parameters()
                                          if p.requires_grad and ".experts." in n),
                head_trained=model.get_output_embeddings().weight.requires_grad,
                root_trained=sum(p.numel() for p in model.parameters() if p.requires_grad)
                - sum(p.numel() for block in decoder_blocks(model) for p in block.parameters() if p.requires_grad),
                nf4_params=sum(nf4), block_nf4=sum(p.numel() for p in block_nf4), largest_nf4=max(nf4, default=0))
        text = text_config(model.config)
        params = sum(p.numel() for p in model.parameters())
        sizes = [sum(p.numel() for p in b.parameters()) for b in decoder_blocks(model)]
        largest, block = _largest_block(model), max(sizes)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        experts, top_k, expert_ffn = expert_shape(model) or (0, 0, 0)
        ffn = top_k * expert_ffn if experts else text.intermediate_size
        block_experts = sum(p.numel() for n, p in largest.named_parameters() if ".experts." in n)
        q_out = max((m.out_features for n, m in model.named_modules() if n.endswith("self_attn.q_proj")), default=0)
        delta_blocks = recurrent_byte_blocks(model.config)
        delta_value_dim = getattr(text, "linear_num_value_heads", 0) * getattr(text, "linear_value_head_dim", 0)
        return cls(params, block, params - sum(sizes), text.num_hidden_layers,
                   text.hidden_size, ffn, text.num_key_value_heads * head_dim,
                   text.num_attention_heads, text.vocab_size,
                   tuple(tuple(p.shape) for p in model.parameters()), experts, top_k, active_parameters(model),
                   block_experts, eager_expert_widths(model), cp_unsupported(model) is None,
                   text.num_attention_heads * head_dim, q_out == 2 * text.num_attention_heads * head_dim,
                   delta_blocks if delta_value_dim else (), delta_value_dim,
                   mlp_tileable=not top_k and tiling_refusal(decoder_blocks(model)) is None)


def moe_bytes_per_token(s: Shapes, ep: int = 1) -> int:
    """What an MoE block keeps per token beyond a dense block of width `ffn` (an estimate, not yet
    fitted on measured peaks): the k dispatched copies of the token (bf16 rows in expert order), the
    experts' outputs in both orders, and the router's float32 input, logits and probabilities; with
    expert parallelism also the rows that arrived and their regrouped copy (k rows per token on
    average: real routing is unbalanced)."""
    if not s.experts:
        return 0
    return 2 * (3 + (2 if ep > 1 else 0)) * s.top_k * s.hidden + 4 * (s.hidden + 2 * s.experts)


# A Qwen3.5 Gated DeltaNet block running flash-linear-attention's kernels keeps a dense block's norms and
# MLP and 12 bytes per value channel more than its attention (its projections, short convolution, expanded
# q and k, the delta rule's saved inputs, its gated norm), 164 KB per token at 9B widths: fitted on the
# whole-run peak of Qwen3.5-9B at 1 row a micro-batch without checkpointing (99.6 GiB on 2 x H200,
# docs/BENCHMARKS.md, issue #45; the fit is about 10, rounded up: 100.4 GiB predicted;
# tests/unit/test_plan.py holds it and a second run). Not yet measured block by block. (Transformers'
# torch reference, which the first runs took unseen, keeps 1.01 MB.) An attention block whose q_proj also makes
# an output gate keeps 8.6 bytes per q channel more than a plain one (154 and 213 KB at 9B and 27B
# widths against the plain block's 119 and 160; scripts/bench_block_memory.py, compiled blocks).
DELTA_BYTES_PER_VALUE_CHANNEL = 12
GATE_BYTES_PER_Q_CHANNEL = 8.6


def layer_bytes_by_kind(s: Shapes, plain_block: float) -> tuple[float, float]:
    """Bytes per token (an attention block, a Gated DeltaNet block) keeps, from what a plain attention
    block of these widths keeps (`plain_block`): the attention block's output gate added where its
    q_proj makes one; a Gated DeltaNet block has the same norms and MLP, the Gated DeltaNet mixer in
    place of attention (0 for a model without Gated DeltaNet blocks)."""
    gate = GATE_BYTES_PER_Q_CHANNEL * s.q_dim if s.gated_attention else 0
    if not s.delta_blocks:
        return plain_block + gate, 0
    return plain_block + gate, plain_block - 2 * 2 * s.kv_dim + DELTA_BYTES_PER_VALUE_CHANNEL * s.delta_value_dim


def _largest_block(model: nn.Module) -> nn.Module:
    """The decoder block with the most parameters (DeepSeek-V3's first layers are dense: its MoE
    blocks are the largest; with LoRA on the experts, theirs hold the most adapters)."""
    return max(decoder_blocks(model), key=lambda block: sum(p.numel() for p in block.parameters()))


@dataclass(frozen=True)
class Setting:
    """What a predicted peak depends on besides the model's shapes (Shapes)."""
    shard_ranks: int
    """the GPUs each parameter is sharded over"""
    tokens: int
    """tokens per micro-batch on this GPU (with context parallelism, its share of the rows)"""
    supervised: int
    """of which supervised (the rows of logits a loss chunk holds)"""
    ac_ratio: float
    """ac.ratio: the share of blocks checkpointed"""
    compiled: bool
    """compile.enabled"""
    reshard_after_forward: bool = True
    """fsdp.reshard_after_forward (False: ZeRO-2, every block gathered from its forward to its backward)"""
    grad_accum: int = 1
    """micro-batches a step (from the second on, the sharded gradients live through forward)"""
    cpu_offload: bool = False
    """fsdp.cpu_offload"""
    float8: bool = False
    """whether the blocks' Linear layers keep their inputs in float8 (float8_saves_inputs)"""
    ac_mode: str = "blocks"
    """ac.mode"""
    cp: int = 1
    """cp.degree: each block's attention also keeps the K/V it all-gathered from the other cp - 1
    ranks (bf16) until its backward, and compiled whole checkpointed blocks the whole row's"""
    ep: int = 1
    """moe.ep_degree: each rank gathers only its 1/ep of a block's experts"""
    state: StateBytes = STATE_BYTES
    """the bytes per trained parameter of optim.master_dtype / state_dtype"""
    reduce_bytes: int = 4
    """fsdp.reduce_dtype's bytes"""
    weight_bytes: int = 2
    """fsdp.param_dtype's bytes, of the gathered and the frozen weights"""
    ac_offload: bool = False
    """ac.offload: the checkpointed blocks' inputs wait in host memory (gone from the GPU's count;
    what op-level modes keep beyond them stays on the GPU)"""
    mlp_tile: int = 0
    """ac.mlp_tile_tokens x the micro-batch's rows, where rows are longer than a tile (else 0): the
    tokens one tile spans; the dense MLPs keep only their input"""


def _gathered_bytes(s: Shapes, run: Setting, compiled: bool) -> float:
    """The weights FSDP holds gathered at once, in fsdp.param_dtype: the current block and the
    prefetched one, or with reshard_after_forward=False (ZeRO-2) every block from its forward to its
    backward, and the root. QLoRA: the NF4 weights are never gathered (every rank holds them), one at a
    time dequantised to bf16 (eager, torchao's dequantisation holds its int64 indices meanwhile:
    NF4_EAGER_DEQUANT_BYTES a value). Sharded over one rank on the GPU, FSDP gathers only the trained
    weights (sft/parallel/fsdp.py: whole_frozen)."""
    trained_only = run.shard_ranks == 1 and not run.cpu_offload
    block = (s.block_trained_params if trained_only else
             s.block_params - s.block_nf4 - s.block_experts * (1 - 1 / run.ep))
    root_trained = s.root_params if s.root_trained is None else s.root_trained
    root = root_trained if trained_only else s.root_params
    dequantised = (run.weight_bytes if compiled else NF4_EAGER_DEQUANT_BYTES) * s.largest_nf4
    return run.weight_bytes * ((2 if run.reshard_after_forward else s.layers) * block + root) + dequantised


def peak_bytes(s: Shapes, run: Setting) -> float:
    """Predicted peak allocated bytes on one GPU of the model of shapes `s` under `run`."""
    sharded_frozen = s.params - s.trained - s.nf4_params  # LoRA: frozen bf16, sharded like the rest
    # Tiled MLPs (sft/parallel/tiled_mlp.py): their tiles' backward is a graph break, which sends a
    # checkpointed block to eager whole; their intermediates live for one tile, in forward and backward.
    tiled = bool(run.mlp_tile) and s.mlp_tileable
    compiled = run.compiled and not (tiled and run.ac_ratio > 0)
    tile_bytes = 2 * 6 * s.ffn * run.mlp_tile if tiled else 0  # gate, up, product and their gradients
    gathered = _gathered_bytes(s, run, compiled) + tile_bytes
    if compiled:
        per_token_layer = 2 * (5 * s.hidden + 3 * s.ffn + 2 * s.kv_dim)
    else:
        per_token_layer = 2 * (10 * s.hidden + 4 * s.ffn + 4 * s.kv_dim)
    if run.float8:  # the Linear inputs kept in float8: q/k/v, o, gate/up, down (a tiled MLP keeps its input in bf16)
        per_token_layer -= 2 * s.hidden if tiled else 3 * s.hidden + s.ffn
    if tiled:
        per_token_layer -= 2 * (3 if compiled else 4) * s.ffn
    per_token_layer += moe_bytes_per_token(s, run.ep)
    if run.ep > 1:  # the experts run eagerly, outside the compiled block: their activations' intermediates too
        per_token_layer += 2 * max(0, s.eager_expert_widths - (3 if compiled else 4)) * s.ffn
    # A hybrid's Gated DeltaNet and attention blocks keep different amounts: each block not checkpointed
    # keeps its kind's, the block recomputed the largest of the checkpointed ones' kinds.
    attention_layer, delta_layer = layer_bytes_by_kind(s, per_token_layer)
    # Under context parallelism a Gated DeltaNet layer runs the whole row (sft/models/gated_deltanet.py:
    # RowParts): the other ranks' share of its convolution's input and of its recurrence's q, k, v
    # (each about twice the value width, bf16) is kept for backward too. Counted, not yet measured.
    delta_layer += (run.cp - 1) * 2 * 4 * s.delta_value_dim
    layer_bytes = [delta_layer if i in s.delta_blocks else attention_layer for i in range(s.layers)]
    checkpointed_blocks = set(ac_block_indices(s.layers, run.ac_ratio))
    checkpointed = len(checkpointed_blocks)
    # bytes per token of a row's gathered K and V (bf16; sft/parallel/context_parallel.py)
    gathered_kv = 2 * 2 * s.kv_dim
    per_token_layer += (run.cp - 1) * gathered_kv  # the other ranks' share
    kept = 2 * s.hidden if run.ac_mode == "blocks" else kept_bytes_per_token(s, compiled, run.ac_mode)
    if run.ac_mode == "blocks" and compiled and run.cp > 1:
        # Measured at 128k-token rows (cp 2 and cp 4, docs/BENCHMARKS.md issue #25): compiled
        # whole-block checkpointing peaks 7-8 GiB above its blocks' inputs and one block's
        # recomputation, the size of every block's all-gathered K/V (the whole row's, cp x this
        # GPU's share), which ac.mode=attention does not; counted here as kept per block.
        kept += run.cp * gathered_kv
    if run.ac_offload:
        kept -= 2 * s.hidden
    kept_whole = sum(b for i, b in enumerate(layer_bytes) if i not in checkpointed_blocks)
    activations = run.tokens * (checkpointed * kept + kept_whole)
    if checkpointed:
        # The block being recomputed: whole, or (ops) the cheap ops' outputs next to what it kept.
        recomputed = max(layer_bytes[i] for i in checkpointed_blocks)
        activations += run.tokens * (recomputed if run.ac_mode == "blocks" else max(0, recomputed - kept))
    rows = min(run.supervised, max(1, LOGITS_PER_CHUNK // s.vocab))
    # one chunk of float32 logits and its gradient, the lm_head's float32 gradient (when it trains),
    # the hidden states and their gradient
    loss = 2 * 4 * rows * s.vocab + (4 * s.head_trained + 2) * s.vocab * s.hidden + 2 * 2 * run.tokens * s.hidden
    # Two candidate peaks: the end of forward (every activation and the loss buffers alive; the
    # sharded gradients only from the second micro-batch of a step on: they are set to None after
    # each step) and the end of backward (all sharded gradients alive, one block's unsharded
    # gradients being reduced, activations gone).
    # With CPU offload the sharded state is on the host; the GPU holds only the fp32 shards of the
    # two blocks in flight (before the bf16 cast of the all-gather; the reduce-scatter output).
    # LoRA: the frozen base in bf16 (sharded) or NF4 (whole), no gradient, no optimizer state.
    if run.cpu_offload:
        state_in_forward = state_in_backward = 2 * run.state.master * s.block_params / run.shard_ranks
    else:
        grads_in_forward = run.state.grad if run.grad_accum > 1 else 0
        nf4 = NF4_BYTES_PER_PARAMETER * s.nf4_params
        frozen = run.weight_bytes * sharded_frozen
        state_in_forward = ((run.state.checkpoint + grads_in_forward) * s.trained + frozen) / run.shard_ranks + nf4
        state_in_backward = (run.state.total * s.trained + frozen) / run.shard_ranks + nf4
    # in the reduce dtype, for the reduce-scatter
    unsharded_grads = run.reduce_bytes * (s.block_trained_params - s.block_trained_expert_params * (1 - 1 / run.ep))
    end_of_forward = state_in_forward + ALLOCATOR_SLACK * (gathered + activations + loss)
    end_of_backward = state_in_backward + ALLOCATOR_SLACK * (gathered + unsharded_grads + run.tokens * max(layer_bytes))
    return max(end_of_forward, end_of_backward)


def gpus_text(count: int) -> str:
    """`count` GPUs, in words ("1 GPU", "8 GPUs")."""
    return f"{count} GPU{'' if count == 1 else 's'}"


@dataclass(frozen=True)
class Machine:
    """What a run plans for: GPUs in all, GiB per GPU, host GiB and GPUs per node."""
    gpus: int
    gpu_mem_gib: float
    host_mem_gib: float
    gpus_per_node: int

    @property
    def gpus_on_a_node(self) -> int:
        return min(self.gpus, self.gpus_per_node)

    def fits(self, gib: float, fraction: float = USABLE_FRACTION) -> bool:
        """Whether a predicted peak of `gib` per GPU fits (`fraction` of the GPU's memory)."""
        return gib <= fraction * self.gpu_mem_gib

    @classmethod
    def of(cls, gpus: int, gpu_mem_gib: float, host_mem_gib: float | None = None,
           gpus_per_node: int | None = None) -> Machine:
        """Defaults: the host memory of this machine (right when it is one of the job's nodes),
        and min(gpus, 8) GPUs per node."""
        return cls(gpus, gpu_mem_gib, host_mem_gib or this_machine_mem_gib(),
                   gpus_per_node or min(gpus, DEFAULT_GPUS_PER_NODE))


def this_machine_mem_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB


def float8_saves_inputs(cfg: Config) -> bool:
    """Whether the blocks' Linear layers keep their inputs in float8 for the backward: torchao's
    float8 layers do; LoRA's float8 base matmuls keep no input (the frozen weight needs no gradient),
    but its adapters keep theirs in bf16."""
    return cfg.precision.float8 != "none" and not cfg.lora.enabled


def tokens_per_gpu(cfg: Config, gpus: int, micro_batch: int) -> int:
    """Tokens of a micro-batch of max_seq_len rows on one GPU: its share of each row under context
    parallelism."""
    return micro_batch * -(-cfg.data.max_seq_len // ParallelDims.of(cfg, gpus).cp)


def predict_gib(s: Shapes, cfg: Config, gpus: int, micro_batch: int, ac_ratio: float, ac_mode: str) -> float:
    """Predicted peak GiB per GPU for `cfg` with this micro-batch (of max_seq_len sequences, each
    split over cp.degree GPUs), ratio and mode, with the grad-acc that keeps the config's global batch."""
    dims = ParallelDims.of(cfg, gpus)  # the degrees of every axis, as the run's mesh will have them
    tokens = tokens_per_gpu(cfg, gpus, micro_batch)
    grad_accum = max(1, cfg.train.micro_batch_size * cfg.train.grad_accum_steps // micro_batch)
    run = Setting(dims.shard_ranks, tokens, tokens // 2, ac_ratio, cfg.compile.enabled, cfg.fsdp.reshard_after_forward,
                  grad_accum, cfg.fsdp.cpu_offload, float8_saves_inputs(cfg), ac_mode, dims.cp, dims.ep,
                  state_bytes(cfg.optim), DTYPES[cfg.fsdp.reduce_dtype].itemsize,
                  DTYPES[cfg.fsdp.param_dtype].itemsize, cfg.ac.offload,
                  cfg.ac.mlp_tile_tokens * micro_batch if 0 < cfg.ac.mlp_tile_tokens < cfg.data.max_seq_len // dims.cp
                  else 0)
    return peak_bytes(s, run) / GIB

