"""Time causal attention forward + backward for one decoder layer of a model's shapes, per kernel.

    python scripts/bench_attention.py --batch 2 --seq 4096 --heads 28 --kv-heads 4 --head-dim 128

Shows which SDPA kernel PyTorch picks by default ("default") and what the others would cost
(docs/BENCHMARKS.md). Each variant is checked against a float32 reference before it is timed.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=28)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()
    b, s, h, kv, d = args.batch, args.seq, args.heads, args.kv_heads, args.head_dim
    gen = torch.Generator("cuda").manual_seed(0)
    q = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
    k = torch.randn(b, kv, s, d, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
    v = torch.randn(b, kv, s, d, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
    grad_out = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    # Causal: forward 2 matmuls of s*s/2*d per head, backward 2.5x forward.
    flops = 3.5 * 2 * 2 * b * h * s * s / 2 * d
    with torch.no_grad():
        reference = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True)

    def repeat(x: torch.Tensor) -> torch.Tensor:
        return x.repeat_interleave(h // kv, dim=1)

    variants = {
        "default, enable_gqa": (None, True),
        "flash, enable_gqa": ([SDPBackend.FLASH_ATTENTION], True),
        "flash, repeated kv": ([SDPBackend.FLASH_ATTENTION], False),
        "cudnn, enable_gqa": ([SDPBackend.CUDNN_ATTENTION], True),
        "cudnn, repeated kv": ([SDPBackend.CUDNN_ATTENTION], False),
        "efficient, repeated kv": ([SDPBackend.EFFICIENT_ATTENTION], False),
    }
    print(f"causal attention fwd+bwd, q [{b}, {h}, {s}, {d}], kv heads {kv}, bf16, {torch.cuda.get_device_name()}")
    for name, (backends, gqa) in variants.items():
        def run() -> torch.Tensor:
            kk, vv = (k, v) if gqa else (repeat(k), repeat(v))
            return F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=gqa)

        def step() -> None:
            run().backward(grad_out)

        try:
            with sdpa_kernel(backends) if backends else contextlib.nullcontext():
                with torch.no_grad():
                    error = ((run().float() - reference).norm() / reference.norm()).item()
                ms = timed(step)
            print(f"  {name:26s} {ms:7.2f} ms  {flops / ms / 1e9:6.0f} TFLOP/s  rel. error {error:.1e}")
        except RuntimeError as e:
            print(f"  {name:26s} unavailable: {str(e).splitlines()[0][:100]}")


if __name__ == "__main__":
    main()
