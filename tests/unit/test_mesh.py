"""The one device mesh: degrees validated together, each rank's place on every axis, the rules the
data, the planner and the checkpoints share."""

import pytest
import torch.distributed as dist

from sft.config import ConfigError
from sft.distributed import init_distributed
from sft.parallel.mesh import ParallelDims

# (world, fsdp.replicate_degree, cp.degree) -> the one error, naming the keys
BAD_DEGREES = {
    (4, 3, 1): "fsdp.replicate_degree=3: must divide the 4 ranks",
    (6, 1, 4): "cp.degree=4: must divide the 6 ranks",
    (4, 4, 2): "fsdp.replicate_degree=4 x cp.degree=2: must divide the 4 ranks",
    (4, 0, 1): "fsdp.replicate_degree=0: must divide the 4 ranks",
}


@pytest.mark.parametrize("world, replicate, cp", list(BAD_DEGREES), ids=list(BAD_DEGREES.values()))
def test_degrees_that_do_not_divide_the_world_are_one_error(world, replicate, cp):
    with pytest.raises(ConfigError) as err:
        ParallelDims(world, replicate, cp)
    assert str(err.value).startswith(BAD_DEGREES[world, replicate, cp])


def test_each_rank_s_place_on_every_axis():
    """8 ranks, 2 replicas, cp 2: cp groups are consecutive ranks; the data-parallel ranks are the
    cp groups; FSDP shards over the 4 ranks of a replica (the layout checkpoints were written in)."""
    places = [ParallelDims(8, replicate=2, cp=2, rank=rank) for rank in range(8)]
    assert [(d.dp_rank, d.cp_rank) for d in places] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (3, 1)]
    dims = places[0]
    assert (dims.dp_size, dims.shard_ranks, dims.cp_enabled, dims.replicated) == (4, 4, True, True)
    assert dims.global_batch(micro_batch_size=2, grad_accum_steps=3) == 2 * 3 * 4
    plain = ParallelDims(8)
    assert (plain.dp_size, plain.shard_ranks, plain.cp_enabled, plain.replicated) == (8, 8, False, False)


def test_a_world_of_one_builds_its_mesh():
    init_distributed()  # a world of one in this process
    try:
        dims = ParallelDims(1).build("cpu")
        assert tuple(dims.fsdp_mesh.shape) == (1,) and dims.cp_mesh is None
    finally:
        dist.destroy_process_group()
