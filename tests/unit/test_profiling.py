"""The profile summary's timeline arithmetic, on a hand-made GPU trace with known answers."""

import gzip
import json

import pytest

from sft.profiling import REPO, kernel_class, memory_at_peak, memory_by_stream, summarize_trace


def kernel(name: str, start: float, dur: float, stream: int) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": start, "dur": dur, "args": {"stream": stream}}


def test_summary_measures_idle_and_exposed_communication(tmp_path):
    # One 1000 us step: a GEMM 0-400, attention 400-500, an NCCL all-gather 300-700 on another
    # stream (100 us of it under the GEMM, 100 under attention, 200 exposed), idle 700-1000.
    events = [{"ph": "X", "cat": "user_annotation", "name": "sft_step#9", "ts": 0, "dur": 1000},
              kernel("sm90_xmma_gemm_bf16bf16", 0, 400, 7), kernel("flash_fwd_kernel", 400, 100, 7),
              kernel("ncclDevKernel_AllGather_RING_LL", 300, 400, 20)]
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    lines = summarize_trace(path).splitlines()
    assert lines[0] == "trace trace.json.gz: 1 profiled steps, 1.0 ms per step (wall)"
    assert lines[1].split() [:5] == ["compute", "kernels", "busy", "0.5", "ms/step"]
    assert "collectives busy          0.4 ms/step, of which under compute 0.2 ms; exposed 0.2 ms" in lines[2]
    assert lines[3].split()[-2:] == ["0.3", "ms/step"]  # GPU idle


@pytest.mark.parametrize("name, label", [
    ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", "nccl"),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<...>", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", "attention"),
    ("nvjet_tst_256x128_64x4_2x1_v_bz_coopA_TNN", "matmul"),
    ("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0", "compiled (triton)"),
    ("void at::native::(anonymous namespace)::fused_adamw_kernel", "optimizer"),
])
def test_kernel_classes(name, label):
    assert kernel_class(name) == label


def test_memory_by_stream_shows_what_each_streams_pool_holds():
    """A hand-made allocator snapshot: the default stream's segment is half free in two blocks, a
    side stream's segment (where FSDP2 used to keep the gradients) is all free."""
    gib = 2**30
    snapshot = {"segments": [
        {"stream": 0, "total_size": 4 * gib, "allocated_size": 2 * gib,
         "blocks": [{"size": 2 * gib, "state": "active_allocated"}, {"size": gib, "state": "inactive"},
                    {"size": gib, "state": "inactive"}]},
        {"stream": 0, "total_size": gib, "allocated_size": gib, "blocks": [{"size": gib, "state": "active_allocated"}]},
        {"stream": 94, "total_size": 8 * gib, "allocated_size": 0, "blocks": [{"size": 8 * gib, "state": "inactive"}]},
    ]}
    lines = memory_by_stream(snapshot).splitlines()
    assert [line.split() for line in lines[2:]] == [["94", "1", "8.00", "0.00", "8.00", "8.00"],
                                                   ["0", "2", "5.00", "3.00", "2.00", "1.00"]]


def test_memory_at_peak_names_what_was_alive_and_where_it_was_allocated():
    """A hand-made allocation history: 10 GiB requested before it, one of them freed during it;
    the peak (15 GiB) is before the eager tensor's free, so the tensor allocated after it is not
    counted."""
    gib = 2**30
    fsdp = {"filename": "/usr/lib/python3/site-packages/torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py",
            "line": 300, "name": "foreach_reduce"}
    ours = {"filename": str(REPO / "sft/parallel.py"), "line": 90, "name": "allocate"}
    compiled = {"filename": "/tmp/torchinductor_u/ab/cabc123.py", "line": 41, "name": "call"}
    block = {"filename": str(REPO / "sft/model.py"), "line": 12, "name": "forward"}
    trace = [{"action": "alloc", "addr": 1, "size": 2 * gib, "frames": [fsdp, ours]},
             {"action": "alloc", "addr": 2, "size": gib, "frames": [compiled, block]},
             {"action": "free_requested", "addr": 99, "size": gib},  # requested before the history
             {"action": "alloc", "addr": 3, "size": 3 * gib, "frames": []},  # eager backward
             {"action": "free_requested", "addr": 3, "size": 3 * gib},
             {"action": "free_completed", "addr": 3, "size": 3 * gib},
             {"action": "alloc", "addr": 4, "size": 2 * gib, "frames": [block]}]
    lines = memory_at_peak({"device_traces": [trace]}, requested_at_start=10 * gib).splitlines()
    assert lines[0] == "memory at its peak in the traced steps: 15.00 GiB requested (6 allocations and frees recorded)"
    assert lines[2].split()[0] == "9.00"  # requested before: 10 GiB less the one freed
    assert [line.split(None, 2) for line in lines[3:]] == [
        ["3.00", "1", "(no Python frame: C++, e.g. an eager op's backward)"],
        ["2.00", "1", "torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py:300 foreach_reduce  <-  "
                      "sft/parallel.py:90 allocate"],
        ["1.00", "1", "compiled cabc123.py:41 call  <-  sft/model.py:12 forward"]]
    wrapped = memory_at_peak({"device_traces": [trace]}, requested_at_start=10 * gib, capacity=len(trace))
    assert "history wrapped (7 entries, the most kept): trace fewer steps" in wrapped
