"""Time causal attention forward + backward for one decoder layer of a model's shapes, per kernel.

    python scripts/bench_attention.py --batch 2 --seq 4096 --heads 28 --kv-heads 4 --head-dim 128
    python scripts/bench_attention.py --batch 1 --seq 32768 65536 --heads 28 --kv-heads 4 --head-dim 128
    python scripts/bench_attention.py --batch 1 --seq 131072 --cp 2 --heads 28 --kv-heads 4 --head-dim 128

Shows which SDPA kernel PyTorch picks by default ("default") and what the others would cost, and
compiled flex attention with a causal block mask (what packing runs; docs/BENCHMARKS.md). Each
variant is checked against a float32 reference (the memory-efficient kernel: no s x s scores, so it
works at 64k) before it is timed. Several --seq values are timed one after the other. Each line
also shows the peak memory the forward + backward allocated beyond q, k, v and grad_out.

--cp N instead times what one rank of a context-parallel group runs (sft/parallel/context_parallel.py): its
head-tail share of the row's queries (seq / N) against the whole row's keys, with the whole-row
causal mask, compiled flex attention.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention


def timed(fn, iters: int = 20) -> float:
    """Median milliseconds of fn() (forward + backward) over iters runs, after 3 warm-ups."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def report(name: str, run, grad_out: torch.Tensor, flops: float, iters: int, reference: torch.Tensor | None) -> None:
    """Time run().backward(grad_out) and print ms, TFLOP/s, extra peak memory and the error."""
    def step() -> None:
        run().backward(grad_out)

    try:
        error = ""
        if reference is not None:
            with torch.no_grad():
                error = f"  rel. error {((run().float() - reference).norm() / reference.norm()).item():.1e}"
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        ms = timed(step, iters)
        peak = (torch.cuda.max_memory_allocated() - before) / 2**30
        print(f"  {name:30s} {ms:8.2f} ms  {flops / ms / 1e9:6.0f} TFLOP/s  peak +{peak:5.2f} GiB{error}", flush=True)
    except (RuntimeError, torch.OutOfMemoryError) as e:
        print(f"  {name:30s} unavailable: {str(e).splitlines()[0][:100]}", flush=True)


def bench_cp_shape(b: int, s: int, h: int, kv: int, d: int, cp: int, iters: int) -> None:
    """One cp rank's attention (rank 0 of the group: chunks 0 and 2 cp - 1 of the row)."""
    from sft.parallel.context_parallel import attention_mask, shard_rows
    from sft.parallel.mesh import ParallelDims

    gen = torch.Generator("cuda").manual_seed(0)
    local = s // cp
    q = torch.randn(b, h, local, d, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
    k = torch.randn(b, kv, s, d, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
    v = torch.randn(b, kv, s, d, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
    grad_out = torch.randn(b, h, local, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    rows = {"input_ids": torch.zeros(b, s, dtype=torch.long), "position_ids": torch.arange(s).expand(b, s),
            "targets": torch.zeros(b, s, dtype=torch.long)}
    _, layout = shard_rows(rows, ParallelDims(cp, cp=cp))
    mask = attention_mask(**{k_: t.cuda() for k_, t in layout.items()})
    compiled_flex = torch.compile(flex_attention)
    flops = 3.5 * 2 * 2 * b * h * s * s / 2 * d / cp  # the rank's share of the row's causal attention
    print(f"context-parallel attention fwd+bwd of one of {cp} ranks: q [{b}, {h}, {local}, {d}] against "
          f"{s} keys, kv heads {kv}, bf16, {torch.cuda.get_device_name()}")
    report("flex (compiled), cp mask", lambda: compiled_flex(q, k, v, block_mask=mask, enable_gqa=True),
           grad_out, flops, iters, None)


def bench_shape(b: int, s: int, h: int, kv: int, d: int, iters: int) -> None:
    gen = torch.Generator("cuda").manual_seed(0)
    q = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
    k = torch.randn(b, kv, s, d, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
    v = torch.randn(b, kv, s, d, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
    grad_out = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    # Causal: forward 2 matmuls of s*s/2*d per head, backward 2.5x forward.
    flops = 3.5 * 2 * 2 * b * h * s * s / 2 * d

    def repeat(x: torch.Tensor) -> torch.Tensor:
        return x.repeat_interleave(h // kv, dim=1)

    with torch.no_grad(), sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        reference = F.scaled_dot_product_attention(q.float(), repeat(k.float()), repeat(v.float()), is_causal=True)
    block_mask = create_block_mask(causal, None, None, s, s, device="cuda")
    compiled_flex = torch.compile(flex_attention)

    def sdpa(backends, gqa):
        def run() -> torch.Tensor:
            kk, vv = (k, v) if gqa else (repeat(k), repeat(v))
            with sdpa_kernel(backends) if backends else contextlib.nullcontext():
                return F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=gqa)
        return run

    variants = {
        "default, enable_gqa": sdpa(None, True),
        "flash, enable_gqa": sdpa([SDPBackend.FLASH_ATTENTION], True),
        "flash, repeated kv": sdpa([SDPBackend.FLASH_ATTENTION], False),
        "cudnn, enable_gqa": sdpa([SDPBackend.CUDNN_ATTENTION], True),
        "cudnn, repeated kv": sdpa([SDPBackend.CUDNN_ATTENTION], False),
        "efficient, enable_gqa": sdpa([SDPBackend.EFFICIENT_ATTENTION], True),
        "efficient, repeated kv": sdpa([SDPBackend.EFFICIENT_ATTENTION], False),
        # What model.attn_implementation=flex_attention runs (packing): compiled, GQA in the kernel.
        "flex (compiled), causal mask": lambda: compiled_flex(q, k, v, block_mask=block_mask, enable_gqa=True),
    }
    print(f"causal attention fwd+bwd, q [{b}, {h}, {s}, {d}], kv heads {kv}, bf16, {torch.cuda.get_device_name()}")
    for name, run in variants.items():
        report(name, run, grad_out, flops, iters, reference)
        q.grad = k.grad = v.grad = None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, nargs="+", default=[4096])
    parser.add_argument("--heads", type=int, default=28)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--iters", type=int, default=20, help="timed runs per variant (median)")
    parser.add_argument("--cp", type=int, default=1, help="time one rank of a context-parallel group of this size")
    args = parser.parse_args()
    for seq in args.seq:
        if args.cp > 1:
            bench_cp_shape(args.batch, seq, args.heads, args.kv_heads, args.head_dim, args.cp, args.iters)
        else:
            bench_shape(args.batch, seq, args.heads, args.kv_heads, args.head_dim, args.iters)


if __name__ == "__main__":
    main()
