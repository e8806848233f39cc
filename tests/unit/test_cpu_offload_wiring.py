"""CPU offload wiring that a CPU machine can check: the process-group backend and the optimizer.
The GPU run itself is `bash scripts/bench_gpu.sh offload`."""

import pytest
import torch

from sft.config import OptimConfig
from sft.distributed import process_group_backend
from sft.training.optim import build_optimizer


@pytest.mark.parametrize("device_type, cpu_offload, backend", [
    ("cuda", True, "cpu:gloo,cuda:nccl"),  # host gradients: the grad-norm all-reduce needs gloo
    ("cuda", False, "nccl"),
    ("cpu", False, "gloo"),
])
def test_process_group_backend(device_type, cpu_offload, backend):
    assert process_group_backend(device_type, cpu_offload) == backend


def test_adamw_is_fused_on_host_shards():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    optimizer = build_optimizer(model, OptimConfig(lr=1e-3))
    assert optimizer.defaults["fused"] is True
    assert [g["weight_decay"] for g in optimizer.param_groups] == [OptimConfig().weight_decay, 0.0]
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()  # the fused kernel runs on CPU tensors
    assert all(s["exp_avg"].dtype == torch.float32 for s in optimizer.state.values())
