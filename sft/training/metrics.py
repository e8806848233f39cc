"""Training metrics: one owner for what a step measured (tokens/s, MFU, memory) and where it goes
(metrics.jsonl, the console or a progress bar, TensorBoard, W&B)."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

from sft import atomic
from sft.compile_cache import compiled_graphs
from sft.config import LoggingConfig
from sft.distributed import DistEnv, all_reduce_sum, log0, to_device
from sft.models.architecture import text_config
from sft.models.layers import attention_layer_count
from sft.models.moe import parameters_per_token
from sft.parallel.mesh import ParallelDims

# Dense (no sparsity) bf16 tensor-core peak FLOP/s, the MFU denominator, by the first entry whose
# text is in torch.cuda.get_device_name() (so the specific "H100 PCIe" comes before "H100").
PEAK_BF16_FLOPS = (
    ("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200", 989e12), ("H800", 989e12),
    ("GH200", 989e12), ("B200", 2250e12), ("A100", 312e12), ("A800", 312e12), ("L40S", 362e12),
)

# The keys of every training entry of metrics.jsonl (docs/checkpoints.md's "Run directory" table lists
# them; tests check both). GPUs with a known peak add "mfu"; the first step adds START_KEYS.
STEP_KEYS = ("step", "loss", "grad_norm", "lr", "tokens", "supervised_tokens", "tokens_seen", "step_time", "eta_s",
             "tokens_per_s_per_gpu", "supervised_tokens_per_s_per_gpu", "peak_memory_gib")
START_KEYS = ("startup_s", "startup_stages_s", "host_peak_rss_gib_per_rank")
# On GPUs every step also logs the caching allocator's side (AllocatorStats).
ALLOCATOR_KEYS = ("peak_reserved_gib", "alloc_retries")


def flops_per_token(trained: int, frozen: int, attention_layers: int, hidden: int, seq_len: int) -> float:
    """Training FLOPs per token: 6 per trained parameter for the matmuls with the weights (forward,
    the input's gradient and the weight's), 4 per frozen one (a LoRA run's base: no weight
    gradient), plus 6*L*s*h for attention scores and values over the L layers that attend (PaLM's
    formula; recomputation not counted; a hybrid's recurrent layers add only their weights')."""
    return 6 * trained + 4 * frozen + 6 * attention_layers * seq_len * hidden


def peak_bf16_flops(device: torch.device) -> float | None:
    """The GPU's dense bf16 peak, or None (CPU, or a GPU not in PEAK_BF16_FLOPS)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS if key in name), None)


class AllocatorStats:
    """The CUDA caching allocator's numbers for each step, then the next step's peaks start afresh
    (an evaluation or a save in between counts toward the next step): the peak allocated
    (peak_memory_gib; a step's own, so the step that peaks can be found), the peak it reserved
    (allocated + cached blocks) and how many retries this step needed (an allocation that did not
    fit made it free its cached blocks and try again, which synchronises the GPU): a run near the
    memory limit can be slower at the same peak_memory_gib because of them (issue #24:
    sft/parallel/fsdp.py:GradientsInComputePool removed the ones every step had). On CPU only
    peak_memory_gib, 0."""

    def __init__(self, device: torch.device):
        self.device, self.retries = device, 0

    def step(self) -> dict:
        if self.device.type != "cuda":
            return {"peak_memory_gib": 0.0}
        stats = torch.cuda.memory_stats(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        retries, before = stats.get("num_alloc_retries", 0), self.retries
        self.retries = retries
        return {"peak_memory_gib": stats.get("allocated_bytes.all.peak", 0) / 2**30,
                "peak_reserved_gib": stats.get("reserved_bytes.all.peak", 0) / 2**30, "alloc_retries": retries - before}


_IMPORTED_AT = time.time()


def seconds_since_process_start() -> float:
    """Wall time since this process was exec'd (Linux /proc), so imports are counted too;
    elsewhere since this module was imported."""
    try:
        start_ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
        uptime = float(open("/proc/uptime").read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time() - _IMPORTED_AT


def host_peak_rss_gib() -> float:
    """Peak resident host memory of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def host_peak_rss_per_rank(env: DistEnv) -> list[float]:
    """Collective: every rank's peak host memory (GiB), e.g. to show that loading is sharded."""
    rss = torch.zeros(env.world_size)
    rss[env.rank] = host_peak_rss_gib()
    return all_reduce_sum(rss, env.device).tolist()


class StartupClock:
    """Where a run's start went, stage by stage: `done(stage)` ends a stage at that moment; the
    first, "imports" (the interpreter and the imports), ended when the clock was made."""

    def __init__(self):
        self.ends = [("imports", seconds_since_process_start())]

    def done(self, stage: str) -> None:
        self.ends.append((stage, seconds_since_process_start()))

    def stages(self) -> dict[str, float]:
        """Each stage's seconds, in order."""
        starts = [0.0] + [end for _, end in self.ends[:-1]]
        return {stage: end - start for (stage, end), start in zip(self.ends, starts)}


class StepMetrics:
    """The numbers of each optimizer step, from the values the loop hands over by name.

    One all-reduce per step carries the loss sum, the token and FLOP counts and the stop flag
    (so every rank learns of a SIGTERM at the same step); reading its result (`read`) is the step's
    only wait for the GPU, and `log_ended` reads a step's after the loop has queued the next step's
    work. The entry `read` returns is a metrics.jsonl line (STEP_KEYS).
    """

    def __init__(self, model: torch.nn.Module, env: DistEnv, total_steps: int, tokens_seen: int,
                 host_peak_rss: list[float], dims: ParallelDims, moe=None, startup: StartupClock | None = None):
        """Made once the run is ready to train: the first step's entry says how long the start took
        (by `startup`'s stages, where given), and `host_peak_rss` (per rank, GiB) how much host
        memory it took. `moe`: the MoE handle of a mixture-of-experts model (sft/models/moe.py): its
        expert loads are logged, and MFU counts the parameters a token runs through."""
        startup_s = seconds_since_process_start()
        stages = startup.stages() if startup else {}
        split = ", ".join(f"{stage} {seconds:.1f} s" for stage, seconds in stages.items())
        log0(f"start-up took {startup_s:.1f} s (process start -> ready to train{': ' * bool(split)}{split})")
        self.first_step_extras = {"startup_s": startup_s, "startup_stages_s": stages,
                                  "host_peak_rss_gib_per_rank": host_peak_rss}
        self._startup_split = split
        text = text_config(model.config)
        # MFU counts the parameters a token runs through (MoE: not the experts it is not routed to),
        # the frozen ones (LoRA's base) at 4 FLOPs, not 6 (flops_per_token).
        self.trained, self.frozen = parameters_per_token(model)
        self.moe = moe if moe and moe.blocks else None  # the general path keeps no statistics of ours
        self.attention_layers, self.hidden = attention_layer_count(model.config), text.hidden_size
        self.env, self.total_steps, self.tokens_seen = env, total_steps, tokens_seen
        # The ranks of a cp group share each row: each counts its 1/degree of the row's tokens.
        self.row_share = 1 / dims.cp
        self.peak_flops = peak_bf16_flops(env.device)
        self.allocator = AllocatorStats(env.device)
        if env.device.type == "cuda" and self.peak_flops is None:
            log0(f"metrics: no bf16 peak known for {torch.cuda.get_device_name(env.device)}; MFU is not reported")
        self.step_times: list[float] = []
        self._began: _Mark | None = None
        self._last_end: _Mark | None = None
        self._in_flight: list[EndedStep] = []  # ended steps whose numbers are on their way from the GPU

    def step_begins(self) -> None:
        # A step's time runs from the end of the step before (the GPU may idle in between, waiting
        # for the host: that counts), unless something else ran since (`pause`).
        self._began = self._last_end or _Mark(self.env.device)

    def pause(self) -> None:
        """What runs until the next step begins (an eval, a save) is no step's time."""
        self._last_end = None

    def step_ends(self, step: int, micro_batches: list[tuple[dict, int]], ce_sum: torch.Tensor,
                  supervised: torch.Tensor, grad_norm: torch.Tensor, lr: float, stop_requested: bool) -> None:
        """Start the step's one all-reduce and the copy of its result to the host; nothing here waits
        for the GPU (`log_ended` reads the result, a step later).

        `micro_batches` are (batch, real tokens) pairs; `ce_sum` is this rank's summed CE,
        `supervised` the global supervised-token count, `grad_norm` the global norm.
        """
        device = self.env.device
        tokens = sum(n for _, n in micro_batches) * self.row_share
        flops = sum(n * flops_per_token(self.trained, self.frozen, self.attention_layers, self.hidden,
                                        b["input_ids"].shape[1])
                    for b, n in micro_batches) * self.row_share
        counted = to_device(torch.tensor([tokens, flops, float(stop_requested)], dtype=torch.float64), device)
        router_stats = [self.moe.step_stats().double().flatten().to(device)] if self.moe else []
        summed = all_reduce_sum(torch.cat([ce_sum.double().view(1).to(device), counted, *router_stats]), device)
        # grad_norm may live on the host (CPU offload): everything on one device, to read it at once.
        values = torch.cat([summed[:4], supervised.double().view(1).to(device),
                            to_device(grad_norm.double().view(1), device), summed[4:]])
        if device.type == "cuda":
            values = torch.empty(values.shape, dtype=values.dtype, pin_memory=True).copy_(values, non_blocking=True)
        self._last_end = _Mark(device)
        # The allocator's numbers are the host's bookkeeping: this step's, now.
        self._in_flight.append(EndedStep(step, lr, self._began, self._last_end, values, self.allocator.step()))

    def log_ended(self, logger: MetricsLogger, now: bool) -> bool:
        """Log the metrics of the steps that ended, but the last one unless `now`; return whether any
        rank asked to stop (then every ended step is logged: the loop leaves).

        The host reads a step's numbers one step late, once the next step's work is queued: reading
        them at once would leave the GPU idle while the host prepares the next step. A save (it
        records the tokens seen), an eval and the last step read at once (`now`); so does a stop,
        which thus comes after the step that follows the request."""
        asked = False
        while self._in_flight and (now or asked or len(self._in_flight) > 1):
            entry, stop = self.read(self._in_flight.pop(0))
            logger.log(entry)
            asked |= stop
        return asked

    def read(self, ended: EndedStep) -> tuple[dict, bool]:
        """Return (the metrics.jsonl entry of a step that `step_ends` ended, whether any rank asked to
        stop); waits for that step's work on the GPU, not for work queued after it."""
        ended.ended.wait()
        values = ended.values
        ce_total, tokens, flops, stops, supervised, grad_norm = values[:6].tolist()
        # The GPU's time from the step's start (the previous step's end, see step_begins) to its end.
        step_time = ended.ended.seconds_since(ended.began)
        tokens = round(tokens)
        self.step_times.append(step_time)
        self.tokens_seen += int(tokens)
        per_gpu = step_time * self.env.world_size
        entry = {"step": ended.step, "loss": ce_total / supervised, "grad_norm": grad_norm, "lr": ended.lr,
                 "tokens": int(tokens), "supervised_tokens": int(supervised), "tokens_seen": self.tokens_seen,
                 "step_time": step_time,
                 "eta_s": (self.total_steps - ended.step) * statistics.median(self.step_times[-20:]),
                 "tokens_per_s_per_gpu": tokens / per_gpu, "supervised_tokens_per_s_per_gpu": supervised / per_gpu,
                 **ended.allocator}
        if self.moe:  # the MoE part: [layers, 1 + experts] sums over ranks
            entry.update(self.moe.summary(values[6:].view(len(self.moe.blocks), -1)))
        if self.peak_flops:
            entry["mfu"] = flops / per_gpu / self.peak_flops
        if len(self.step_times) == 1:
            entry.update(self.first_step_extras)
            graphs, compiled = compiled_graphs(), ""
            if any(graphs.values()):  # what the first step (and what ran before this read) compiled
                uncached = f", {graphs['uncached']} not cacheable" if graphs["uncached"] else ""
                compiled = (f" (torch.compile: {graphs['from_cache']} graphs from the cache, {graphs['compiled']} "
                            f"compiled{uncached})")
            # (the step-0 evaluation between them not counted)
            log0(f"start-up and step 1 took {entry['startup_s'] + step_time:.1f} s: "
                 f"{self._startup_split}{', ' * bool(self._startup_split)}step 1 {step_time:.1f} s{compiled}")
        return entry, stops > 0


class _Mark:
    """A moment in the order of the device's work: on a GPU a timing event queued on the stream
    (reached once everything queued before it has run), on the CPU the host's clock (its work
    runs as it is issued)."""

    def __init__(self, device: torch.device):
        self.event, self.time = None, None
        if device.type == "cuda":
            self.event = torch.cuda.Event(enable_timing=True)
            self.event.record()
        else:
            self.time = time.perf_counter()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def seconds_since(self, earlier: _Mark) -> float:
        """Seconds of the device's time between `earlier` and this mark (after `wait`)."""
        if self.event is not None:
            return earlier.event.elapsed_time(self.event) / 1000
        return self.time - earlier.time


@dataclasses.dataclass
class EndedStep:
    """A step whose numbers are on their way to the host (StepMetrics.step_ends -> read)."""

    step: int
    lr: float
    began: _Mark
    ended: _Mark  # queued after the copy of `values`
    values: torch.Tensor  # on the host: pinned memory that the GPU copies to, or the CPU's own tensor
    allocator: dict


class MetricsLogger:
    """Rank 0's sinks for step metrics: metrics.jsonl (always), the console or a progress bar,
    TensorBoard and Weights & Biases (optional; imported only when enabled).

    metrics.jsonl has one JSON object per optimizer step with the keys documented in docs/checkpoints.md
    ("Run directory"), and one {"step", "eval_loss"} object per evaluation. A run resumed at step
    N trains steps N+1, ... again: the entries the interrupted run wrote past N are dropped first
    (atomically; TensorBoard's purge_step does the same to its events), so each step has one entry
    however often a run resumes.
    """

    def __init__(self, run_dir: Path, cfg: LoggingConfig, run_name: str, config: dict, total_steps: int,
                 start_step: int, enabled: bool):
        self.enabled, self.cfg, self.total_steps = enabled, cfg, total_steps
        self.evaluations: dict[int, float] = {}  # step -> eval loss, as logged by the run so far
        if not enabled:
            return
        path = run_dir / "metrics.jsonl"
        if start_step and path.exists():
            kept = [line for line in path.read_text().splitlines(keepends=True)
                    if (step := _step_of(line)) is not None and step <= start_step]
            atomic.write_file(path, "".join(kept))
            self.evaluations = {entry["step"]: entry["eval_loss"] for entry in map(json.loads, kept)
                                if "eval_loss" in entry}
        self.jsonl = open(path, "a" if start_step else "w")
        self.bar = None
        if cfg.progress == "bar" or (cfg.progress == "auto" and sys.stdout.isatty()):
            from tqdm import tqdm
            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)
        self.tensorboard = None
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.tensorboard = SummaryWriter(str(run_dir / "tb"), purge_step=start_step + 1 if start_step else None)
        self.wandb = None
        if cfg.wandb_project:
            import wandb
            self.wandb = wandb.init(project=cfg.wandb_project, name=run_name, config=config,
                                    dir=str(run_dir), resume="allow")

    def log(self, entry: dict) -> None:
        if not self.enabled:
            return
        self.jsonl.write(json.dumps(entry) + "\n")
        self.jsonl.flush()
        step = entry["step"]
        scalars = {k: v for k, v in entry.items() if isinstance(v, (int, float)) and k != "step"}
        if self.tensorboard:
            for key, value in scalars.items():
                self.tensorboard.add_scalar(key, value, step)
        if self.wandb:
            self.wandb.log(scalars, step=step)
        if "loss" not in entry:  # an evaluation
            self.message(f"step {step}: eval loss {entry['eval_loss']:.4f}")
        elif self.bar:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix(loss=f"{entry['loss']:.4f}", tok_s_gpu=f"{entry['tokens_per_s_per_gpu']:,.0f}")
        elif step % self.cfg.every_steps == 0 or step == self.total_steps:
            self.message(format_step(entry, self.total_steps))

    def message(self, text: str) -> None:
        """A log line that does not break the progress bar."""
        if not self.enabled:
            return
        line = time.strftime("[%H:%M:%S] ") + text
        if self.bar:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if not self.enabled:
            return
        self.jsonl.close()
        if self.bar:
            self.bar.close()
        if self.tensorboard:
            self.tensorboard.close()
        if self.wandb:
            self.wandb.finish()


def _step_of(line: str) -> int | None:
    """The step of a metrics.jsonl line, None for a line a killed run left unfinished."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return None


def read_metrics(run_dir: Path) -> tuple[dict[int, dict], dict[int, float]]:
    """A run's metrics.jsonl as (step -> training entry, step -> eval loss)."""
    steps, evals = {}, {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        entry = json.loads(line)
        if "eval_loss" in entry:
            evals[entry["step"]] = entry["eval_loss"]
        else:
            steps[entry["step"]] = entry
    return steps, evals


def format_step(entry: dict, total_steps: int) -> str:
    line = (f"step {entry['step']}/{total_steps} | loss {entry['loss']:.4f} | grad norm {entry['grad_norm']:.3f} | "
            f"lr {entry['lr']:.2e} | {entry['tokens_per_s_per_gpu']:,.0f} tok/s/gpu")
    if "mfu" in entry:
        line += f" | MFU {entry['mfu']:.1%} | peak {entry['peak_memory_gib']:.1f} GiB"
    if "aux_loss" in entry:  # MoE: the worst layer's expert load
        line += (f" | aux {entry['aux_loss']:.4f} | load max/mean {max(entry['expert_load_max_over_mean']):.2f}, "
                 f"{sum(entry['dead_experts'])} dead")
    if entry.get("alloc_retries"):
        line += f" | {entry['alloc_retries']} allocator retries"
    return line + f" | {entry['step_time']:.2f} s/step | ETA {datetime.timedelta(seconds=round(entry['eta_s']))}"
