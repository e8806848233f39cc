"""Memory planner: predict per-GPU peak memory and pick the activation checkpointing (ratio and
mode) and micro-batch that fit.

    python -m sft.plan --config configs/qwen72b.yaml --gpus 64 --gpu-mem 80

Peak = the larger of two moments; what is allocated and freed within a block or micro-batch
(gathered blocks, activations, loss buffers, unsharded gradients) gets 5% allocator slack, the
sharded state (weights, moments, gradients: the same large tensors every step) none. End of forward: fp32 params and both Adam
moments (12 bytes per parameter over the shard group; gradients are None between steps, so +4
from the second micro-batch of a step on), the gathered bf16 blocks (current + prefetched, or with
ZeRO-2 every block until its backward; the root's embeddings and lm_head), activations (a
checkpointed block keeps only its input, the others everything backward needs, plus one block
being recomputed) and the loss buffers (one chunk of fp32 logits and its gradient, the fp32
lm_head gradient formed in forward). End of backward: all 16 bytes per parameter of sharded
state, the gathered blocks, one block's unsharded gradients (fp32, or bf16 with
fsdp.reduce_dtype=bfloat16) and one block's activations.
optim.master_dtype / state_dtype = bfloat16 make the 16 bytes 12 (bf16 moments) or 8 (and bf16
weights and gradients): sft/training/optim.py:state_bytes. Under expert parallelism (moe.ep_degree)
a rank gathers only its share of each block's experts, and keeps the rows that arrived for them.
The activation bytes per token and layer are 2 x (10 h + 4 ffn + 4 kv) in eager mode (bf16
tensors an RMSNorm/attention/SwiGLU block saves) and 2 x (5 h + 3 ffn + 2 kv) compiled (the fused
graph recomputes cheap pointwise results instead of saving them); the compiled counts are fitted on
the measured peaks of Qwen2.5-0.5B, 7B and 14B shapes, whose ffn/h ratios differ (5.4, 5.3, 2.7).
Mixture-of-experts blocks count as a dense block of the width a token runs through (top-k experts'
intermediate sizes) plus the dispatch and router buffers (moe_bytes_per_token); their gathered
weights are all experts' (FSDP gathers whole blocks). Under expert parallelism the experts run
eagerly, and keep what their activation saves (counted by running it: gpt-oss's clamped SwiGLU
keeps 7 tensors of the expert's width per routed row, Qwen3's 4). Three measured MoE peaks
(docs/BENCHMARKS.md, issue #36) are within 10%.
With precision.float8 (full fine-tuning) the inputs of the block's Linear layers (3 h + ffn values) are saved as
float8, one byte each. A block checkpointed with ac.mode=ops keeps its input and what its
matmuls and attention produce, all or every second matmul with ops_half, attention's only with
attention (ops_bytes_per_token; float8 matmuls still produce bf16). docs/BENCHMARKS.md "Memory
planner" and its issue #24 and #25 sections compare the predictions with 45 measured peaks
(0.5B-72B widths, with and without offload, float8 and context parallelism). Other architectures are estimates: leave a margin.

With LoRA (lora.rank > 0) only the adapters and modules_to_save carry the 16 bytes of state; the
frozen base is its fsdp.param_dtype weights, sharded, or with lora.base=nf4 the adapted weights in
NF4 (0.516 bytes a parameter, whole on every GPU, one matrix dequantised at a time); the activations
add the adapters' inputs and rank-wide outputs. The "LoRA and QLoRA" section of docs/BENCHMARKS.md
compares 8 measured LoRA and QLoRA peaks (P-7B and 72B) with it: 1-9% below the prediction.

With fsdp.cpu_offload the GPU holds no sharded state (no 12/16 bytes per parameter): only the fp32
shards of the two blocks in flight (copied in before the bf16 cast for the all-gather, or the
reduce-scatter output before its copy out). The host of each node holds, per GPU, the fp32 shards
of the parameters and gradients in pinned memory (PyTorch's pinned allocator rounds each to a power
of two), both Adam moments (8 bytes per parameter) and the process itself (HOST_PROCESS_GIB):
about 16 bytes x parameters x GPUs-per-node / shard ranks, plus the rounding and the processes;
with periodic asynchronous saves, 12 bytes more per parameter shard for the staged copy of the state.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from sft.config import DTYPES, Config, ConfigError, LoRAConfig, ModelConfig, load_config
from sft.config.checks import range_checks
from sft.errors import run_command
from sft.models.build import ModelError, build_meta_model, decoder_blocks
from sft.models.lora import NF4_BYTES_PER_PARAMETER, apply_lora, nf4_weights
from sft.models.moe import active_parameters, eager_expert_widths, expert_shape
from sft.parallel.activation_checkpointing import AC_MODES, ac_block_indices, kept_bytes_per_token, recompute_fraction
from sft.parallel.context_parallel import unsupported
from sft.parallel.mesh import ParallelDims
from sft.training.loss import LOGITS_PER_CHUNK
from sft.training.optim import STATE_BYTES, StateBytes, state_bytes

GIB = 2**30
ALLOCATOR_SLACK = 1.05
# One rank's own host footprint (CUDA context, libraries, Python): 1.8 GiB RSS per rank measured
# after loading 14B without offload (docs/BENCHMARKS.md); an assumption the offload bench checks.
HOST_PROCESS_GIB = 2.0
DEFAULT_GPUS_PER_NODE = 8
# Shapes (config.json only) of the models the configs name, for planning where the hub is not reachable.
SHIPPED_SHAPES = Path(__file__).resolve().parents[1] / "configs" / "models"
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
    # LoRA (sft/models/lora.py): the parameters that train (all, without it), those of one block,
    # whether the lm_head trains; QLoRA: the base weights stored in NF4 (in all, in one block: whole
    # on every rank) and the largest of them (dequantised to bf16 one matrix at a time).
    trained_params: int | None = None
    block_trained: int | None = None
    head_trained: bool = True
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

    @classmethod
    def of(cls, model: nn.Module, lora: LoRAConfig | None = None) -> Shapes:
        """The shapes of `model` (a meta-device model), trained as `lora` says (on it: it is changed)."""
        if lora is not None and lora.enabled:
            apply_lora(model, decoder_blocks(model), dataclasses.replace(lora, base="bfloat16"), torch.bfloat16)
            nf4 = [p.numel() for p in nf4_weights(model)] if lora.base == "nf4" else []
            block_nf4 = nf4_weights(decoder_blocks(model)[0]) if nf4 else []
            return dataclasses.replace(
                cls.of(model), trained_params=sum(p.numel() for p in model.parameters() if p.requires_grad),
                block_trained=sum(p.numel() for p in decoder_blocks(model)[0].parameters() if p.requires_grad),
                head_trained=model.get_output_embeddings().weight.requires_grad,
                nf4_params=sum(nf4), block_nf4=sum(p.numel() for p in block_nf4), largest_nf4=max(nf4, default=0))
        text = model.config.get_text_config()
        params = sum(p.numel() for p in model.parameters())
        block = sum(p.numel() for p in decoder_blocks(model)[0].parameters())
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        experts, top_k, expert_ffn = expert_shape(model) or (0, 0, 0)
        ffn = top_k * expert_ffn if experts else text.intermediate_size
        block_experts = sum(p.numel() for n, p in decoder_blocks(model)[0].named_parameters() if ".experts." in n)
        return cls(params, block, params - block * text.num_hidden_layers, text.num_hidden_layers,
                   text.hidden_size, ffn, text.num_key_value_heads * head_dim,
                   text.num_attention_heads, text.vocab_size,
                   tuple(tuple(p.shape) for p in model.parameters()), experts, top_k, active_parameters(model),
                   block_experts, eager_expert_widths(model), unsupported(model, moe=experts > 0) is None,
                   text.num_attention_heads * head_dim)


def moe_bytes_per_token(s: Shapes, ep: int = 1) -> int:
    """What an MoE block keeps per token beyond a dense block of width `ffn` (an estimate, not yet
    fitted on measured peaks): the k dispatched copies of the token (bf16 rows in expert order), the
    experts' outputs in both orders, and the router's float32 input, logits and probabilities; with
    expert parallelism also the rows that arrived and their regrouped copy (k rows per token on
    average: real routing is unbalanced)."""
    if not s.experts:
        return 0
    return 2 * (3 + (2 if ep > 1 else 0)) * s.top_k * s.hidden + 4 * (s.hidden + 2 * s.experts)


def peak_bytes(s: Shapes, shard_ranks: int, tokens: int, supervised: int, ac_ratio: float, compiled: bool,
               reshard_after_forward: bool = True, grad_accum: int = 1, cpu_offload: bool = False,
               float8: bool = False, ac_mode: str = "blocks", cp: int = 1, ep: int = 1,
               state: StateBytes = STATE_BYTES, reduce_bytes: int = 4) -> float:
    """Predicted peak allocated bytes on one GPU for `tokens` tokens per micro-batch on that GPU
    (with context parallelism, its share of the rows). `cp`: cp.degree; each block's attention
    then also keeps the K/V it all-gathered from the other cp - 1 ranks (bf16) until its backward,
    and compiled whole checkpointed blocks hold the size of the whole row's (see below). `ep`:
    moe.ep_degree, each rank gathers only its 1/ep of a block's experts. `state`: the bytes per
    trained parameter of optim.master_dtype / state_dtype; `reduce_bytes`: fsdp.reduce_dtype's."""
    # bf16 blocks gathered at once: the current and the prefetched one, or with
    # reshard_after_forward=False (ZeRO-2) every block from its forward to its backward. QLoRA: the
    # NF4 weights are never gathered (every rank holds them), one at a time dequantised to bf16.
    sharded_frozen = s.params - s.trained - s.nf4_params  # LoRA: frozen bf16, sharded like the rest
    block_bytes = 2 * (s.block_params - s.block_nf4 - s.block_experts * (1 - 1 / ep))
    gathered = (2 if reshard_after_forward else s.layers) * block_bytes + 2 * s.root_params + 2 * s.largest_nf4
    if compiled:
        per_token_layer = 2 * (5 * s.hidden + 3 * s.ffn + 2 * s.kv_dim)
    else:
        per_token_layer = 2 * (10 * s.hidden + 4 * s.ffn + 4 * s.kv_dim)
    if float8:
        per_token_layer -= 3 * s.hidden + s.ffn  # the Linear inputs: q/k/v, o, gate/up, down
    per_token_layer += moe_bytes_per_token(s, ep)
    if ep > 1:  # the experts run eagerly, outside the compiled block: their activations' intermediates too
        per_token_layer += 2 * max(0, s.eager_expert_widths - (3 if compiled else 4)) * s.ffn
    checkpointed = len(ac_block_indices(s.layers, ac_ratio))
    gathered_kv = 2 * 2 * s.kv_dim  # bytes per token of a row's gathered K and V (bf16; sft/parallel/context_parallel.py)
    per_token_layer += (cp - 1) * gathered_kv  # the other ranks' share
    kept = 2 * s.hidden if ac_mode == "blocks" else kept_bytes_per_token(s, compiled, ac_mode)
    if ac_mode == "blocks" and compiled and cp > 1:
        # Measured at 128k-token rows (cp 2 and cp 4, docs/BENCHMARKS.md issue #25): compiled
        # whole-block checkpointing peaks 7-8 GiB above its blocks' inputs and one block's
        # recomputation, the size of every block's all-gathered K/V (the whole row's, cp x this
        # GPU's share), which ac.mode=attention does not; counted here as kept per block.
        kept += cp * gathered_kv
    activations = tokens * (checkpointed * kept + (s.layers - checkpointed) * per_token_layer)
    if checkpointed:
        # The block being recomputed: whole, or (ops) the cheap ops' outputs next to what it kept.
        activations += tokens * (per_token_layer if ac_mode == "blocks" else max(0, per_token_layer - kept))
    rows = min(supervised, max(1, LOGITS_PER_CHUNK // s.vocab))
    # one chunk of float32 logits and its gradient, the lm_head's float32 gradient (when it trains),
    # the hidden states and their gradient
    loss = 2 * 4 * rows * s.vocab + (4 * s.head_trained + 2) * s.vocab * s.hidden + 2 * 2 * tokens * s.hidden
    # Two candidate peaks: the end of forward (every activation and the loss buffers alive; the
    # sharded gradients only from the second micro-batch of a step on: they are set to None after
    # each step) and the end of backward (all sharded gradients alive, one block's unsharded
    # gradients being reduced, activations gone).
    # With CPU offload the sharded state is on the host; the GPU holds only the fp32 shards of the
    # two blocks in flight (before the bf16 cast of the all-gather; the reduce-scatter output).
    # LoRA: the frozen base in bf16 (sharded) or NF4 (whole), no gradient, no optimizer state.
    if cpu_offload:
        state_in_forward = state_in_backward = 2 * state.master * s.block_params / shard_ranks
    else:
        grads_in_forward = state.grad if grad_accum > 1 else 0
        nf4 = NF4_BYTES_PER_PARAMETER * s.nf4_params
        state_in_forward = ((state.checkpoint + grads_in_forward) * s.trained + 2 * sharded_frozen) / shard_ranks + nf4
        state_in_backward = (state.total * s.trained + 2 * sharded_frozen) / shard_ranks + nf4
    # in the reduce dtype, for the reduce-scatter
    unsharded_grads = reduce_bytes * (s.block_trained_params - s.block_experts * (1 - 1 / ep))
    end_of_forward = state_in_forward + ALLOCATOR_SLACK * (gathered + activations + loss)
    end_of_backward = state_in_backward + ALLOCATOR_SLACK * (gathered + unsharded_grads + tokens * per_token_layer)
    return max(end_of_forward, end_of_backward)


def host_bytes_per_rank(s: Shapes, shard_ranks: int, staged_checkpoints: bool = False) -> float:
    """Host bytes one rank holds with fsdp.cpu_offload (see the module docstring)."""
    # FSDP2 shards dim 0, padded to a multiple of the shard ranks.
    shards = [math.ceil(shape[0] / shard_ranks) * math.prod(shape[1:]) for shape in s.param_shapes]
    # FSDP pins each parameter's shard, and each gradient's copy to the host lands in a pinned
    # block; PyTorch's caching pinned allocator rounds every block up to a power of two.
    pinned = 2 * sum(1 << (4 * n - 1).bit_length() for n in shards)
    staged = STATE_BYTES.checkpoint * sum(shards) if staged_checkpoints else 0  # the state the writer writes
    return pinned + STATE_BYTES.optimizer * sum(shards) + staged + HOST_PROCESS_GIB * GIB


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


def host_gib_per_node(s: Shapes, cfg: Config, m: Machine) -> float:
    """Predicted host GiB per node with fsdp.cpu_offload (its ranks' shards, pinned rounding, processes)."""
    return m.gpus_on_a_node * host_bytes_per_rank(s, ParallelDims.of(cfg, m.gpus).shard_ranks,
                                                  cfg.checkpoint.stages_in_host_memory) / GIB


def host_problem(s: Shapes, cfg: Config, m: Machine) -> str | None:
    """Why the host side of fsdp.cpu_offload does not fit the node, or None (also without offload)."""
    if not cfg.fsdp.cpu_offload:
        return None
    need = host_gib_per_node(s, cfg, m)
    if need <= m.host_mem_gib:
        return None
    staging = ", checkpoint.async_save=false" if cfg.checkpoint.stages_in_host_memory else ""
    return (f"fsdp.cpu_offload needs {need:.0f} GiB of host memory per node ({m.gpus_on_a_node} GPUs "
            f"per node) > {m.host_mem_gib:.0f} GiB: use more nodes (more shard ranks), fewer GPUs per node{staging} "
            "or fsdp.cpu_offload=false")


RATIOS = (0.0, 0.25, 0.5, 0.75, 1.0)
MODES = tuple(AC_MODES)
# (ac.ratio, ac.mode) settings the planner tabulates and plan.auto chooses from; ratio 0 has no mode.
AC_SETTINGS = tuple((ratio, mode) for ratio in RATIOS for mode in MODES if ratio > 0 or mode == "blocks")
MICRO_BATCHES = (1, 2, 4, 8)


def recompute_cost(s: Shapes, seq_len: int, ac_ratio: float, ac_mode: str) -> float:
    """Recomputed work per step in whole-block forwards: what plan.auto minimises."""
    return len(ac_block_indices(s.layers, ac_ratio)) * recompute_fraction(s, seq_len, ac_mode)


def as_overrides(ratio: float, mode: str, micro_batch: int, grad_accum: int) -> str:
    """A setting (as `suggest` returns it) as the command-line overrides that select it."""
    return (f"ac.ratio={ratio:g} ac.mode={mode} train.micro_batch_size={micro_batch} "
            f"train.grad_accum_steps={grad_accum}")


def ac_label(ac_ratio: float, ac_mode: str) -> str:
    return f"ac {ac_ratio:g}" + (f" {ac_mode}" if ac_mode != "blocks" else "")


def float8_saves_inputs(cfg: Config) -> bool:
    """Whether the blocks' Linear layers keep their inputs in float8 for the backward: torchao's
    float8 layers do; LoRA's float8 base matmuls keep no input (the frozen weight needs no gradient),
    but its adapters keep theirs in bf16."""
    return cfg.precision.float8 != "none" and not cfg.lora.enabled


def predict_gib(s: Shapes, cfg: Config, gpus: int, micro_batch: int, ac_ratio: float, ac_mode: str) -> float:
    """Predicted peak GiB per GPU for `cfg` with this micro-batch (of max_seq_len sequences, each
    split over cp.degree GPUs), ratio and mode, with the grad-acc that keeps the config's global batch."""
    tokens = micro_batch * -(-cfg.data.max_seq_len // cfg.cp.degree)
    grad_accum = max(1, cfg.train.micro_batch_size * cfg.train.grad_accum_steps // micro_batch)
    return peak_bytes(s, ParallelDims.of(cfg, gpus).shard_ranks, tokens, tokens // 2, ac_ratio, cfg.compile.enabled,
                      cfg.fsdp.reshard_after_forward, grad_accum, cfg.fsdp.cpu_offload,
                      float8_saves_inputs(cfg), ac_mode, cfg.cp.degree, cfg.moe.ep_degree,
                      state_bytes(cfg.optim), DTYPES[cfg.fsdp.reduce_dtype].itemsize) / GIB


def suggest(s: Shapes, cfg: Config, m: Machine) -> tuple[float, str, int, int] | None:
    """(ac.ratio, ac.mode, micro_batch_size, grad_accum_steps) that fits and keeps the global batch:
    settings at the configured micro-batch or a larger one first (a smaller one adds grad-acc
    steps, each with its own all-gathers and reduce-scatters, which recomputation does not weigh),
    then the least recomputation (recompute_cost; on 2 x H100, P-7B bf16, each whole block rerun
    cost 0.55% of a step), then the largest micro-batch (of MICRO_BATCHES and the configured one),
    then whole blocks before op-level modes. None if nothing fits the GPUs, or, with
    fsdp.cpu_offload, the host (no setting here changes that)."""
    if host_problem(s, cfg, m):
        return None
    dims = ParallelDims.of(cfg, m.gpus)
    global_batch, data_parallel = dims.global_batch(cfg.train.micro_batch_size, cfg.train.grad_accum_steps), dims.dp_size
    fits = [(micro < cfg.train.micro_batch_size, recompute_cost(s, cfg.data.max_seq_len, ratio, mode), -micro,
             MODES.index(mode), ratio, mode)
            for micro in {*MICRO_BATCHES, cfg.train.micro_batch_size} for ratio, mode in AC_SETTINGS
            if global_batch % (micro * data_parallel) == 0 and predict_fit(s, cfg, m, micro, ratio, mode)[1]]
    if not fits:
        return None
    *_, micro, _, ratio, mode = min(fits)
    return ratio, mode, -micro, global_batch // (-micro * data_parallel)


CP_DEGREES = (1, 2, 4, 8)


def smallest_cp(s: Shapes, cfg: Config, m: Machine) -> int | None:
    """The smallest cp.degree (within a node, dividing the GPUs) at which one row of
    data.max_seq_len tokens per micro-batch fits with some activation checkpointing, or None; only
    1 for a model whose rows cannot be split."""
    for degree in CP_DEGREES if s.context_parallel else (1,):
        if m.gpus % (degree * cfg.fsdp.replicate_degree) or degree > m.gpus_on_a_node:
            continue
        at = dataclasses.replace(cfg, cp=dataclasses.replace(cfg.cp, degree=degree))
        if any(predict_fit(s, at, m, 1, ratio, mode)[1] for ratio, mode in AC_SETTINGS):
            return degree
    return None


def _nothing_fits(cfg: Config, m: Machine) -> str:
    offload = "" if cfg.fsdp.cpu_offload else "fsdp.cpu_offload=true, "
    return (f"nothing fits {m.gpu_mem_gib:.0f} GiB per GPU on {m.gpus} GPUs: use more GPUs, {offload}a larger "
            "cp.degree or a shorter data.max_seq_len")


def planning_model(cfg: ModelConfig) -> tuple[nn.Module, str]:
    """The meta model to plan for, and a note. A hub model this machine cannot fetch (a login node
    without network) is planned from its shapes in configs/models, when they are shipped."""
    try:
        return build_meta_model(cfg), ""
    except ModelError:
        shipped = SHIPPED_SHAPES / cfg.name_or_path.split("/")[-1].lower().removesuffix("-instruct")
        if "/" not in cfg.name_or_path or not (shipped / "config.json").is_file():
            raise
        note = f" (the hub is not reachable: shapes from {shipped})"
        return build_meta_model(dataclasses.replace(cfg, name_or_path=str(shipped))), note


def plan(cfg: Config, m: Machine, host_mem_note: str = "") -> tuple[str, bool]:
    """The planner's report, and whether any setting fits (GPU and, with offload, host)."""
    model, shapes_note = planning_model(cfg.model)
    s = Shapes.of(model, cfg.lora)
    active = f" ({s.active_params / 1e9:.2f}B active: {s.top_k} of {s.experts} experts per token)" if s.experts else ""
    lines = [f"{cfg.model.name_or_path}{shapes_note}: {s.params / 1e9:.2f}B parameters{active}, {s.layers} blocks, {m.gpus} GPUs "
             f"({ParallelDims.of(cfg, m.gpus).shard_ranks}-way sharding), {cfg.data.max_seq_len} tokens per sequence"
             + (f" split over cp.degree={cfg.cp.degree} GPUs" if cfg.cp.degree > 1 else "") + ", "
             f"budget {m.gpu_mem_gib:.0f} GiB/GPU, of which {USABLE_FRACTION:.0%} for the peak"
             + (f" ({ROUTED_USABLE_FRACTION:.0%} under expert parallelism where routed rows are kept across blocks)"
                if s.experts else "")
             + (", fsdp.cpu_offload: no sharded state on the GPUs" if cfg.fsdp.cpu_offload else "")
             + (f", moe.ep_degree={cfg.moe.ep_degree}" if cfg.moe.ep_degree > 1 else "")
             + f", {state_bytes(cfg.optim).total} bytes of state per trained parameter", "",
             "| micro-batch | " + " | ".join(ac_label(*setting) for setting in AC_SETTINGS) + " |",
             "|---" * (len(AC_SETTINGS) + 1) + "|"]
    for micro in MICRO_BATCHES:
        cells = [predict_fit(s, cfg, m, micro, ratio, mode) for ratio, mode in AC_SETTINGS]
        lines.append(f"| {micro} | " + " | ".join(f"{g:.1f}" + ("" if ok else " ✗") for g, ok in cells) + " |")
    current, fits = predict_fit(s, cfg, m, cfg.train.micro_batch_size, cfg.ac.ratio, cfg.ac.mode)
    mode = f", ac.mode {cfg.ac.mode}" if cfg.ac.mode != "blocks" else ""
    lines += ["", f"this config (micro-batch {cfg.train.micro_batch_size}, ac.ratio {cfg.ac.ratio:g}{mode}): "
                  f"{current:.1f} GiB per GPU predicted" + (" — fits" if fits else " — does NOT fit")]
    if cfg.checkpoint.enabled:
        each, at_once = state_bytes(cfg.optim).checkpoint * s.trained / GIB, cfg.checkpoint.most_on_disk
        lines.append(f"checkpoints: {each:.1f} GiB each (weights and Adam moments), up to {at_once} at once "
                     f"(checkpoint.keep_last + the one being written): {each * at_once:.1f} GiB of train.output_dir")
    if cfg.fsdp.cpu_offload:
        need = host_gib_per_node(s, cfg, m)
        per_rank = need / m.gpus_on_a_node
        lines.append(f"host (fsdp.cpu_offload): {need:.1f} GiB per node predicted ({m.gpus_on_a_node} GPUs "
                     f"per node x {per_rank:.1f} GiB: fp32 params + grads pinned, Adam moments, "
                     + ("the checkpoint staging, " if cfg.checkpoint.stages_in_host_memory else "") + "the process) for "
                     f"{m.host_mem_gib:.0f} GiB{host_mem_note}" + (" — does NOT fit" if need > m.host_mem_gib else " — fits"))
    choice = suggest(s, cfg, m)
    if choice:
        _, _, micro, accum = choice
        lines.append(f"suggested: {as_overrides(*choice)} (global batch {ParallelDims.of(cfg, m.gpus).global_batch(micro, accum)})")
    else:
        lines.append(host_problem(s, cfg, m) or _nothing_fits(cfg, m))
        if roomier := roomier_layout(s, cfg, m):
            roomier_cfg, roomier_choice, overrides = roomier
            state = f"{state_bytes(roomier_cfg.optim).total} bytes of state per parameter"
            lean = any(key.startswith("optim.") for key in overrides)
            overrides = _as_text(overrides)
            if roomier_choice is None:
                least = min(predict_gib(s, roomier_cfg, m.gpus, micro, ratio, mode)
                            for micro in MICRO_BATCHES for ratio, mode in AC_SETTINGS)
                lines.append(f"nor with {overrides} ({state}): the least any setting needs is {least:.1f} GiB per GPU")
            else:
                ratio, mode, micro, _ = roomier_choice
                predicted = predict_gib(s, roomier_cfg, m.gpus, micro, ratio, mode)
                lines.append(f"it fits with: {overrides} {as_overrides(*roomier_choice)} ({predicted:.1f} GiB per GPU "
                             f"predicted, {state}; plan.auto chooses it"
                             + (" with plan.allow_lean_state=true)" if lean else ")"))
    degree = smallest_cp(s, cfg, m)
    if degree is not None and degree != cfg.cp.degree:
        lines.append(f"context parallelism: cp.degree={degree} is the smallest at which a row of "
                     f"{cfg.data.max_seq_len} tokens fits (python -m sft.plan ... cp.degree={degree} for its table)")
    return "\n".join(lines), choice is not None


def _set(cfg: Config, overrides: dict) -> None:
    """Set "section.name" keys of `cfg` in place."""
    for key, value in overrides.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)


def _as_text(overrides: dict) -> str:
    return " ".join(f"{key}={value}" for key, value in overrides.items())


def roomier_layout(s: Shapes, cfg: Config, m: Machine, lean: bool = True) -> tuple[Config, tuple | None, dict] | None:
    """The first layout, in this order, with which some setting fits where `cfg`'s does not: expert
    parallelism over a whole replica (MoE models: each GPU gathers only its share of a block's
    experts; the same numerics), then with `lean` also bf16 Adam moments, then also bf16 master
    weights and gradient reduction. Each step adds to the ones before; a step the config's checks
    refuse (sft/config/checks.py: e.g. bf16 masters with LoRA) is left out. As (config, suggest's
    choice, its overrides); where none fits, the roomiest with choice None; None if there is none."""
    shard_ranks = ParallelDims.of(cfg, m.gpus).shard_ranks
    steps = []
    if s.experts and cfg.moe.ep_degree == 1 and shard_ranks > 1 and s.experts % shard_ranks == 0:
        steps.append({"moe.ep_degree": shard_ranks})
    if lean:
        steps += [{"optim.state_dtype": "bfloat16"}, {"optim.master_dtype": "bfloat16", "fsdp.reduce_dtype": "bfloat16"}]
    roomier, overrides = cfg, {}
    for step in steps:
        candidate = copy.deepcopy(roomier)
        _set(candidate, step)
        if candidate == roomier or range_checks(candidate, local_checks=False):
            continue  # already so, or refused
        roomier, overrides = candidate, {**overrides, **step}
        if choice := suggest(s, roomier, m):
            break
    if roomier is cfg:
        return None
    return roomier, choice, overrides


def apply_auto_plan(cfg: Config, gpus: int, gpu_mem_gib: float, host_mem_gib: float | None = None,
                    gpus_per_node: int | None = None) -> str:
    """plan.auto: set ac.ratio / micro-batch / grad-acc in `cfg` from the planner; cp.degree where
    rows do not fit at the configured one; where still nothing fits, expert parallelism (MoE) and,
    if plan.allow_lean_state, the optimizer's bf16 state (roomier_layout); return a log line.
    Host defaults as in Machine.of: train.py runs on one of the job's nodes."""
    shapes, m = Shapes.of(build_meta_model(cfg.model), cfg.lora), Machine.of(gpus, gpu_mem_gib, host_mem_gib, gpus_per_node)
    choice, note = suggest(shapes, cfg, m), ""
    degree = smallest_cp(shapes, cfg, m) if choice is None else None
    if degree is not None and degree > cfg.cp.degree:
        # Rows do not fit at the configured degree: split them over more GPUs (fewer data-parallel
        # ranks, so the global batch has fewer rows). Before anything that changes the numerics.
        cfg.cp.degree, note = degree, f"cp.degree={degree} "
        choice = suggest(shapes, cfg, m)
    roomier = roomier_layout(shapes, cfg, m, lean=cfg.plan.allow_lean_state) if choice is None else None
    if roomier is not None and roomier[1] is not None:
        _, choice, overrides = roomier
        _set(cfg, overrides)
        note = _as_text(overrides) + " "
    if choice is None:
        raise ConfigError(f"plan.auto: {host_problem(shapes, cfg, m) or _nothing_fits(cfg, m)}")
    configured = (cfg.ac.ratio, cfg.ac.mode, cfg.train.micro_batch_size, cfg.train.grad_accum_steps)
    cfg.ac.ratio, cfg.ac.mode, cfg.train.micro_batch_size, cfg.train.grad_accum_steps = choice
    predicted = predict_gib(shapes, cfg, gpus, cfg.train.micro_batch_size, cfg.ac.ratio, cfg.ac.mode)
    return (f"plan.auto: {note}{as_overrides(*choice)} (predicted {predicted:.1f} GiB per GPU"
            + ("" if choice == configured else f"; the config said {as_overrides(*configured)}") + ")")


def gpu_memory_gib(cfg: Config, device) -> float | None:
    """The GPU memory to plan for: plan.gpu_mem_gib, else the GPU's own; None on a CPU without it."""
    if cfg.plan.gpu_mem_gib:
        return cfg.plan.gpu_mem_gib
    return torch.cuda.get_device_properties(device).total_memory / GIB if device.type == "cuda" else None


def check_fits(cfg: Config, world_size: int, gpu_mem_gib: float, host_mem_gib: float | None = None,
               gpus_per_node: int | None = None) -> str | None:
    """A warning if the planner predicts this run exceeds the GPU's memory (or, with fsdp.cpu_offload,
    the node's host memory), else None."""
    s = Shapes.of(build_meta_model(cfg.model), cfg.lora)
    m = Machine.of(world_size, gpu_mem_gib, host_mem_gib, gpus_per_node)
    predicted, fits = predict_fit(s, cfg, m, cfg.train.micro_batch_size, cfg.ac.ratio, cfg.ac.mode)
    fraction = usable_fraction(s, cfg, cfg.ac.ratio, cfg.ac.mode)
    problems = [] if fits else [f"{predicted:.0f} GiB per GPU, more than {fraction:.0%} of {gpu_mem_gib:.0f} GiB GPUs"]
    if host_problem(s, cfg, m):
        problems.append(f"{host_gib_per_node(s, cfg, m):.0f} GiB of host memory per node for {m.host_mem_gib:.0f} GiB")
    if not problems:
        return None
    return (f"warning: the memory planner predicts {' and '.join(problems)}; see `python -m sft.plan --config "
            f"<this config> --gpus {world_size} --gpu-mem {gpu_mem_gib:.0f}`")


def main(argv: list[str] | None = None) -> int:
    """Print the plan; exit status 1 when nothing fits, so a script can stop before queueing."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--gpus", type=int, required=True, help="total number of GPUs")
    parser.add_argument("--gpu-mem", type=float, default=80, help="GiB per GPU you allow the run to use")
    parser.add_argument("--host-mem", type=float, default=None,
                        help="with fsdp.cpu_offload: host GiB per node you allow the run to use "
                             "(default: this machine's memory, right only if it is one of the job's nodes)")
    parser.add_argument("--gpus-per-node", type=int, default=None,
                        help=f"with fsdp.cpu_offload: GPUs per node (default: min(--gpus, {DEFAULT_GPUS_PER_NODE}))")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args(argv)  # overrides may come before and after the options
    m = Machine.of(args.gpus, args.gpu_mem, args.host_mem, args.gpus_per_node)
    note = "" if args.host_mem else " (this machine's memory: pass --host-mem for the compute nodes')"
    report, fits = plan(load_config(args.config, args.overrides, local_checks=False), m, note)
    print(report)
    return 0 if fits else 1


if __name__ == "__main__":
    run_command(main)
