"""The config tree: one dataclass per section; the string literal under each field is its
documentation (docs/configuration.md is generated from them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from sft.config.ac_modes import AC_MODES

# The dtype names the config accepts (fsdp.*_dtype, checkpoint.export_dtype) and what they mean.
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
# The fused lm_head + cross-entropy (sft/training/loss.py) computes its float32 logits in chunks of
# this many (1 GiB whatever the vocabulary size); the planner counts one chunk. Here, in the lowest
# floor, so that the planner need not load the loss (which loads FSDP and flex attention).
LOGITS_PER_CHUNK = 2**28


@dataclass
class ModelConfig:
    name_or_path: str = ""
    """Hugging Face hub id (e.g. Qwen/Qwen2.5-7B-Instruct) or a local directory with config.json
    (and *.safetensors when init=pretrained). Required."""
    init: Literal["pretrained", "random"] = "pretrained"
    """pretrained: load the safetensors weights. random: the architecture's own random init
    (demo, benchmarks); no weights are read."""
    tokenizer: str | None = None
    """Tokenizer hub id or directory; defaults to name_or_path."""
    trust_remote_code: bool = False
    """Allow custom modeling code from the hub. Off unless you trust the repository."""
    attn_implementation: str = "sdpa"
    """Attention kernel passed to transformers (sdpa, eager, flex_attention, flash_attention_2, ...).
    Where the architecture cannot run it (gpt-oss has no sdpa), the run says so once and uses
    flex_attention on GPUs or eager; exports and sft.chat do not depend on it."""
    prepared_cache: str | None = None
    """A directory for a one-time sharded (DCP) copy of the loaded float32 model: the first run
    writes it, later runs of the same model load it instead of the Hugging Face files. Only a run
    whose weights are all float32 writes it (a LoRA base or bf16 masters would hand later runs
    rounded weights); LoRA runs read it for the base, their adapters start from their own init."""


@dataclass
class DataConfig:
    path: str = ""
    """Hub dataset name, or a local .jsonl / .json / .parquet file. Required."""
    subset: str | None = None
    """Hub dataset configuration name (the 'subset'), if it has several."""
    split: str = "train"
    """Split to train on."""
    max_samples: int | None = None
    """Keep only the first N rows of the file (conversations, after the seeded shuffle); the rows an
    expanded conversation trains in count as one."""
    eval_path: str | None = None
    """Optional separate held-out file or hub dataset (same format as path)."""
    eval_fraction: float = 0.0
    """Fraction of the rows held out for eval loss when eval_path is not given (0 = none). Split by
    conversation: an expanded conversation's rows stay on one side."""
    max_seq_len: int = 2048
    """Samples are truncated to this many tokens."""
    train_on: Literal["all_assistant", "last_assistant"] = "all_assistant"
    """Which assistant turns are supervised, each as generated at inference. all_assistant: every turn;
    with a chat template that rewrites history (Qwen3) a conversation becomes one row per turn group,
    repeating the history (O(turns^2) tokens; `python -m sft.data --stats` shows the cost).
    last_assistant: the final turn only, earlier turns are context; one row per conversation."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Variables for the chat template at every render, e.g. {enable_thinking: false} for Qwen3;
    use the values you will serve with."""
    pad_to: Literal["longest", "max_seq_len"] = "longest"
    """Right-pad each micro-batch to its longest sample, or always to max_seq_len (benchmarks)."""
    packing: bool = False
    """Pack samples into rows of max_seq_len tokens (best-fit decreasing), no attention across
    samples: no padding waste. On GPUs pair it with model.attn_implementation: flex_attention."""
    pad_to_multiple_of: int = 64
    """Round padded lengths up to a multiple of this, so compiled blocks see few shapes."""
    num_proc: int = 1
    """Processes for tokenisation (datasets.map)."""
    cache_dir: str | None = None
    """datasets cache directory (tokenised data is cached there; a rerun starts fast)."""


@dataclass
class TrainConfig:
    output_dir: str = "runs"
    """Parent directory of run directories."""
    run_name: str = "sft"
    """The run directory is output_dir/run_name."""
    seed: int = 0
    """Seeds data order, random init and every RNG."""
    epochs: int = 1
    """Passes over the training data (ignored when max_steps is set)."""
    max_steps: int | None = None
    """Stop after this many optimizer steps."""
    micro_batch_size: int = 1
    """Sequences per GPU (per rank) per forward/backward."""
    grad_accum_steps: int = 1
    """Micro-batches per optimizer step. Global batch = micro_batch_size x grad_accum_steps x
    data-parallel ranks (the ranks / cp.degree)."""
    overwrite: bool = False
    """Allow writing into a run directory that already holds a finished run."""


@dataclass
class OptimConfig:
    lr: float = 1e-5
    """Peak learning rate (AdamW)."""
    min_lr: float = 0.0
    """Learning rate at the end of the cosine decay."""
    warmup_ratio: float = 0.0
    """Fraction of the optimizer steps spent in linear warmup."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW)."""
    decay_norms_and_biases: bool = False
    """Also apply weight decay to 1-D parameters (norm weights, biases). Usually off."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    clip_grad_norm: float | None = 1.0
    """Clip the global gradient norm to this value (null = no clipping; the norm is still logged)."""
    state_dtype: Literal["float32", "bfloat16"] = "float32"
    """AdamW's two moments: float32 (8 bytes per trained parameter), or bfloat16 (4 bytes, written
    with stochastic rounding so that their small per-step changes are not rounded away; math in
    float32). Measured on a 0.39B model: eval loss +0.5% on average over two seeds (at steps
    1,000 and 900), +1.3% on one: above the 1% goal there (docs/BENCHMARKS.md, issue #36)."""
    master_dtype: Literal["float32", "bfloat16"] = "float32"
    """The trained weights the optimizer updates: float32 masters (4 bytes per parameter, and
    float32 gradients: 4 more), or bfloat16 ones updated with stochastic rounding (2 + 2 bytes:
    FSDP hands the reduced gradients back in the weights' dtype). With state_dtype bfloat16 the
    state is 8 bytes per parameter instead of 16. Needs fsdp.param_dtype=bfloat16 and
    fsdp.reduce_dtype=bfloat16: the gradients are bf16 either way, and FSDP would cast a float32
    reduction's result on its own stream, whose freed memory (28 GiB for Qwen3-30B-A3B on 2 GPUs)
    the next forward cannot use (measured: allocator retries every step). Not with LoRA or
    fsdp.cpu_offload. plan.allow_lean_state lets plan.auto choose these two. Measured (both
    bfloat16): eval loss +0.9% on average over two seeds, +1.5% on one."""


@dataclass
class FSDPConfig:
    param_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Compute dtype of the all-gathered parameters (the master weights: optim.master_dtype)."""
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the gradient reduce-scatter. bfloat16 halves traffic at some precision cost; with
    float32 master weights it measured slower near the memory limit (its float32 copies of the
    gradients bring back allocator retries: sft/parallel/fsdp.py:GradientsInComputePool)."""
    reshard_after_forward: bool = True
    """Free gathered blocks after their forward (ZeRO-3). False keeps them until backward (≈ZeRO-2)."""
    replicate_degree: int = 1
    """HSDP: >1 replicates the model over this many groups and shards within each (e.g. the number
    of nodes, so all-gathers stay inside a node). With cp.degree, must divide the number of ranks."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer states in host memory (CPUOffloadPolicy)."""
    sync_grads_each_microbatch: bool = True
    """Reduce-scatter gradients after every micro-batch. False defers it to the last micro-batch of
    the step (less communication, but unsharded gradients stay in memory)."""


@dataclass
class PrecisionConfig:
    float8: Literal["none", "tensorwise", "rowwise"] = "none"
    """Float8 matmuls in the decoder blocks' Linear layers (torchao; pip install -e '.[fp8]'), on
    GPUs of compute capability >= 8.9 (H100, H200, L40S), with compile.enabled. tensorwise: one
    scale per tensor and float8 FSDP all-gathers, the fastest; rowwise: one scale per row, more
    accurate, slower. The lm_head and embeddings stay bf16; master weights, Adam moments and
    checkpoints stay float32 with the same keys as without float8 (none <-> float8 resume works).
    With LoRA: the adapted layers' frozen base matmuls, in our own kernel (no torchao; docs/lora.md)."""


@dataclass
class ACConfig:
    ratio: float = 0.0
    """Fraction of decoder blocks wrapped in activation checkpointing, spread evenly over depth
    (0 = none, 1 = all). See sft/parallel/activation_checkpointing.py:ac_block_indices for the exact blocks."""
    mode: Literal[tuple(AC_MODES)] = "blocks"
    """How a checkpointed block saves memory. blocks: keep only its input and recompute the whole
    block in backward (least memory). ops: keep the outputs of its matmuls and of attention (output
    and log-sum-exp) and recompute only the cheap ops around them (norms, rotary, SiLU): almost no
    recomputation, ~70% of an unchecked block's activations on Qwen2.5-7B shapes. ops_half: the same
    but every second matmul is recomputed (TorchTitan's default): ~40% of the activations. attention:
    keep only attention's output and log-sum-exp and recompute everything else, matmuls included:
    at long context the most expensive kernel is not rerun, for one more bf16 vector per token per
    block. python -m sft.plan shows the memory of each; works with compile, float8, packing and FSDP2."""
    offload: bool = False
    """Keep each checkpointed block's input in host memory (pinned) instead of on the GPU until its
    backward: copied out after its forward, back when its backward recomputes it (what op-level
    modes keep beyond it stays on the GPU). For rows too long for the GPU to hold every block's
    input (256k tokens of a 4096-wide model: 2 GiB a block); costs two copies a block and step over
    PCIe, and host memory per GPU of tokens x hidden x 2 bytes, rounded up to a power of two, per
    checkpointed block (python -m sft.plan counts it). Needs ac.ratio > 0."""
    mlp_tile_tokens: int = 0
    """Dense MLPs run this many tokens of a row at a time, rerun tile by tile in backward: no row-long MLP
    intermediate, for one more MLP forward a step (0 = off; e.g. 16384 at 64k+; docs/long-context.md)."""


@dataclass
class LoRAConfig:
    rank: int = 0
    """Train low-rank adapters (LoRA) of this rank on the target linear layers and freeze the rest of
    the model: no gradient, optimizer state or checkpoint for the frozen base, stored in
    fsdp.param_dtype. 0 trains every parameter (full fine-tuning). See docs/lora.md."""
    alpha: float = 16.0
    """The adapter's output is scaled by alpha / rank (PEFT's lora_alpha)."""
    dropout: float = 0.0
    """Dropout on the adapter's input (PEFT's lora_dropout); the frozen path sees the input as is."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """The decoder blocks' Linear layers that get adapters, by the last part of their name (e.g.
    [q_proj, v_proj]); all-linear: every one (shared experts and dense MLPs included). `experts`:
    the routed experts of mixture-of-experts blocks too, one adapter per expert on each fused
    weight (gate_up_proj, down_proj), exported as PEFT's target_parameters; e.g. [all-linear,
    experts]. Without it the routed experts stay frozen."""
    modules_to_save: list[str] = field(default_factory=list)
    """Modules trained in full besides the adapters, by name (e.g. [embed_tokens, lm_head] for new
    tokens); saved in the checkpoints and the exported adapter."""
    base: Literal["bfloat16", "nf4"] = "bfloat16"
    """The frozen base's storage: the compute dtype (fsdp.param_dtype), or nf4 (QLoRA: the adapted
    layers' weights in 4-bit NormalFloat with double-quantised scales, torchao; each rank reads them
    one at a time and keeps all of them, 0.52 bytes a parameter, unsharded; the rest stays bf16)."""
    allow_resume_change: bool = False
    """Resume a LoRA checkpoint although the base's weights or lora.alpha differ from those its
    adapters were trained with (each checkpoint records them). Off, such a resume is refused: the
    adapters were fitted to that base at that scale."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        """What an adapter's output is multiplied by: alpha / rank (PEFT's scaling, without rsLoRA)."""
        return self.alpha / self.rank


@dataclass
class MoEConfig:
    aux_loss_coef: float | None = None
    """Coefficient of the load-balancing loss of mixture-of-experts models (null: the model's
    router_aux_loss_coef from config.json, e.g. 0.001 for Qwen3-MoE; 0 turns it off). Switch-style,
    per layer over each micro-batch's real tokens, weighted so the step's total does not depend on
    ranks or grad-accum steps (sft/models/moe.py says exactly what is computed)."""
    train_router: bool = True
    """Train the routers. False freezes them (the load-balancing loss then only reaches the hidden
    states through the router's input; set aux_loss_coef: 0 to drop it). With LoRA (lora.rank > 0)
    the routers are frozen with the rest of the base."""
    bias_update_rate: float = 0.0
    """DeepSeek-V3-style routers (DeepSeek-V3, Kimi-K2, Moonlight, GLM-4.5, MiniMax-M2), which choose
    experts by their scores plus a correction bias (e_score_correction_bias): after each optimizer
    step every bias moves by this much towards balance, up for the experts that got fewer tokens
    than the mean over the step (all ranks), down for the others (DeepSeek-V3 used 0.001). 0 keeps
    the checkpoint's bias, as the reference implementation does. Kept in checkpoints."""
    ep_degree: int = 1
    """Expert parallelism: each of this many consecutive ranks holds 1/ep_degree of every MoE
    block's experts (whole experts, FSDP-sharded over the other ranks) and the tokens routed to
    them are sent there and back (dropless: all-to-all of exactly the routed rows, one host sync
    per block forward for the split sizes). 1 turns it off: the experts are FSDP-sharded like
    every other weight and all-gathered in every block. Must divide the ranks and the number of
    experts; checkpoints resume at any degree. With cp.degree, the rows' parts travel from every
    rank of a cp group alike. Not with fsdp.replicate_degree > 1 or lora.base=nf4 yet. Over every
    rank, bf16 experts stay whole outside FSDP. Measured on 2 H200, Qwen3-30B-A3B widths: 10 blocks
    without AC 1.7% faster than 1; the whole model checkpointed half as fast while its blocks ran
    eagerly (now one op, to be measured: docs/BENCHMARKS.md, issue #62)."""


@dataclass
class CPConfig:
    degree: int = 1
    """Context parallelism: split every row's tokens over this many ranks (consecutive ranks, so
    keep it within a node), for rows longer than one GPU's activations allow (python -m sft.plan
    suggests the smallest degree that fits data.max_seq_len). Keys and values are all-gathered per
    layer and documents of packed rows stay isolated. Must divide the number of ranks; the data
    is spread over ranks / degree data-parallel ranks (train.grad_accum_steps says the global
    batch). Checkpoints resume at any degree. See docs/long-context.md."""


@dataclass
class CompileConfig:
    enabled: bool = False
    """torch.compile each decoder block (after activation checkpointing, before FSDP)."""
    cache_dir: str | None = None
    """Where compiled kernels are kept across processes (torch.compile's graphs, Triton's kernels and
    autotuning results, tilelang's), so that a relaunch (a Slurm requeue, the next run of the same
    shapes) compiles nothing it compiled before. null: where TORCHINDUCTOR_CACHE_DIR /
    TRITON_CACHE_DIR / TILELANG_CACHE_DIR already point, else ~/.cache/sft/compile. A folder the
    nodes share serves every rank and job (sft/compile_cache.py)."""


@dataclass
class EvalConfig:
    every_steps: int = 0
    """Compute the held-out loss every N optimizer steps (0 = only before and after training)."""


@dataclass
class CheckpointConfig:
    enabled: bool = True
    """Write checkpoints (at the end, every_steps, and on SIGTERM/SIGUSR1). Off for benchmarks."""
    every_steps: int = 0
    """Save a checkpoint every N optimizer steps (0 = only at the end, and on SIGTERM/SIGUSR1)."""
    keep_last: int = 2
    """Keep this many committed checkpoints; older ones are deleted after a new one is committed."""
    async_save: bool = True
    """Periodic saves (every_steps) write in the background: training waits only while each rank's
    shards are copied to host memory (12 bytes x parameters / ranks per rank: fp32 weights and both
    Adam moments, kept for the run). The checkpoint is committed once every rank has written it.
    The final save and the stop-save (SIGTERM/SIGUSR1) are always synchronous."""
    resume: str = "auto"
    """auto: continue from the newest complete checkpoint of this run, if any; none: start fresh;
    or the path of a checkpoints/step-N directory."""
    export_hf: bool = False
    """At the end, also write a Hugging Face model directory to <run>/export."""
    export_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Dtype of the exported weights."""

    @property
    def most_on_disk(self) -> int:
        """Checkpoints on disk at once while saving: keep_last committed ones stay while the next is
        written (retention runs only after its commit)."""
        return self.keep_last + 1

    @property
    def stages_in_host_memory(self) -> bool:
        """Whether periodic asynchronous saves keep a host copy of the sharded state for the run."""
        return self.enabled and self.async_save and self.every_steps > 0


@dataclass
class LoggingConfig:
    every_steps: int = 1
    """Print a log line every N optimizer steps (metrics.jsonl always gets every step)."""
    progress: Literal["auto", "bar", "lines"] = "auto"
    """bar: a progress bar instead of per-step log lines; lines: log lines; auto: the bar only when
    stdout is a terminal (so Slurm logs get plain lines)."""
    tensorboard: bool = False
    """Also write scalars to <run>/tb for TensorBoard (pip install tensorboard)."""
    wandb_project: str | None = None
    """Also log to this Weights & Biases project (pip install wandb)."""
    profile_steps: tuple[int, int] | None = None
    """[first, last]: trace these optimizer steps on rank 0 with torch.profiler into <run>/profile
    (a Perfetto/chrome://tracing trace and summary.txt: GPU time by kernel class, idle and
    exposed-communication time; on GPUs also the allocator's memory by stream and what was alive
    at the steps' peak of allocated memory, by where it was allocated, with memory-rank0.pickle for
    pytorch.org/memory_viz). Skip the first steps: they compile. Traced steps run slower and
    keep their allocation history in host memory (a few KB per allocation)."""


@dataclass
class DistConfig:
    timeout_minutes: float = 15.0
    """Timeout of every collective: a rank that died or hangs stops the others after this long
    instead of leaving them waiting. Work that keeps ranks waiting for longer (rank 0 tokenising a
    large dataset on the first run) waits outside it; the HF export runs after the process group
    is gone."""


@dataclass
class PlanConfig:
    auto: bool = False
    """On GPUs, let the memory planner (python -m sft.plan) choose ac.ratio, ac.mode,
    train.micro_batch_size and train.grad_accum_steps, keeping the global batch: the least
    recomputation that fits with room to spare for the allocator (sft/plan/search.py:suggest);
    where nothing fits at the configured cp.degree, ac.offload (if the node's host memory holds the
    blocks' inputs), then tiled MLPs (ac.mlp_tile_tokens), then a larger cp.degree."""
    gpu_mem_gib: float | None = None
    """Memory per GPU to plan for (default: the GPU's total memory). Set, it also lets plan.auto
    choose without a GPU (e.g. to see its choice on a CPU machine)."""
    allow_lean_state: bool = False
    """Let plan.auto set optim.state_dtype and then optim.master_dtype to bfloat16 (16 -> 12 -> 8
    bytes of state per parameter) where the run does not fit otherwise. It takes these before expert
    parallelism (moe.ep_degree), measured faster on every whole MoE model, so an MoE run that would
    fit with expert parallelism and float32 state gets the lean state instead. Off: it never changes
    the optimizer's numerics (and expert parallelism is what plan.auto tries where nothing fits)."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    ac: ACConfig = field(default_factory=ACConfig)
    cp: CPConfig = field(default_factory=CPConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.train.output_dir) / self.train.run_name

    @property
    def checkpoints_dir(self) -> Path:
        return self.run_dir / "checkpoints"
