"""Host staging for asynchronous saves: a copy of the state that later saves refill in place."""

import tempfile

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard, init_device_mesh

from sft.checkpoint.staging import HostStaging


@pytest.fixture(scope="module")
def mesh():
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def test_staging_copies_once_then_refills_the_same_buffers(mesh):
    weight = DTensor.from_local(torch.arange(6.0).reshape(3, 2), mesh, [Shard(0)])
    state = {"model": {"w": weight}, "optimizer": {"state": {"w": {"step": torch.tensor(3.0)}},
                                                  "param_groups": [{"lr": 1e-3, "params": ["w"]}]}}
    staging = HostStaging()
    first = staging.stage(state)
    staged_w = first["model"]["w"]
    assert isinstance(staged_w, DTensor) and staged_w.placements == (Shard(0),)
    assert staged_w.to_local().data_ptr() != weight.to_local().data_ptr()  # a copy, not the live tensor

    # Training goes on: the staged copy keeps the values of its save...
    weight.to_local().add_(1)
    state["optimizer"]["state"]["w"]["step"].fill_(4)
    state["optimizer"]["param_groups"][0]["lr"] = 5e-4
    assert staged_w.to_local().tolist() == [[0, 1], [2, 3], [4, 5]]
    assert first["optimizer"]["state"]["w"]["step"].item() == 3

    # ...and the next save refills the same buffers with the new values, and takes the new scalars.
    second = staging.stage(state)
    assert second["model"]["w"] is staged_w
    assert staged_w.to_local().tolist() == [[1, 2], [3, 4], [5, 6]]
    assert second["optimizer"]["state"]["w"]["step"].item() == 4
    assert second["optimizer"]["param_groups"][0]["lr"] == 5e-4


def test_a_tensor_that_changed_shape_or_dtype_gets_a_new_buffer(mesh):
    staging = HostStaging()
    state = {"a": torch.ones(3), "b": torch.ones(2), "betas": (0.9, torch.ones(2))}
    first = staging.stage(state)
    second = staging.stage({"a": torch.full((4,), 2.0), "b": torch.ones(2, dtype=torch.float64),
                            "betas": (0.9, torch.zeros(2))})
    assert second["a"].tolist() == [2.0] * 4 and second["a"] is not first["a"]
    assert second["b"].dtype == torch.float64 and second["b"] is not first["b"]
    assert isinstance(second["betas"], tuple) and second["betas"][1] is first["betas"][1]  # same layout: refilled
    assert second["betas"][1].tolist() == [0.0, 0.0]


def test_buffers_made_ahead_are_the_ones_the_first_save_fills(mesh):
    weight = DTensor.from_local(torch.arange(6.0).reshape(3, 2), mesh, [Shard(0)])
    state = {"model": {"w": weight}, "optimizer": {"param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95)}]}}
    staging = HostStaging()
    staging.allocate(state, rank=0)
    made = staging._buffers["/model/w"]
    assert isinstance(made, DTensor) and made.placements == (Shard(0),) and made.to_local().device.type == "cpu"
    staged = staging.stage(state)
    assert staged["model"]["w"] is made and made.to_local().tolist() == [[0, 1], [2, 3], [4, 5]]
    assert staged["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.95)
