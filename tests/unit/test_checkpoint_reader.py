"""The checkpoint reader: a DCP checkpoint's tensors read straight into their destinations, equal to
torch's own reader, with what it cannot read directly handed to torch's reader."""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

import sft.checkpoint.reader
from sft.checkpoint.reader import CheckpointReader, read_checkpoint


@pytest.fixture
def handed_on(monkeypatch) -> list[str]:
    """The names of the items torch's own reader reads (the rest are read directly)."""
    names = []
    torch_reader = dcp.FileSystemReader.read_data
    monkeypatch.setattr(dcp.FileSystemReader, "read_data", lambda self, plan, planner: names.extend(
        i.dest_index.fqn for i in plan.items) or torch_reader(self, plan, planner))
    return names


SAVED = {"weight": torch.randn(64, 32, generator=torch.Generator().manual_seed(0)),
         "bf16": torch.randn(5, 7).to(torch.bfloat16), "ids": torch.arange(9), "scalar": torch.tensor(3.5),
         "transposed": torch.randn(6, 8).t(), "cast": torch.randn(4, 4), "step": 7, "name": "adamw"}


@pytest.mark.parametrize("offsets", [True, False], ids=["torch says where the data is", "torch does not say"])
def test_tensors_are_read_into_their_destinations_as_torch_reads_them(tmp_path, monkeypatch, handed_on, offsets):
    dcp.save({"model": SAVED}, checkpoint_id=tmp_path, no_dist=True)
    if not offsets:  # an older torch: every record goes to torch's reader
        monkeypatch.setattr(sft.checkpoint.reader, "_record_data_offset", lambda saved: None)
    into = {name: torch.zeros_like(value) if isinstance(value, torch.Tensor) else None for name, value in SAVED.items()}
    into["cast"] = torch.zeros(4, 4, dtype=torch.bfloat16)  # the destination's dtype wins, as in torch's reader
    into["transposed"] = torch.zeros(6, 8).t()  # a strided destination
    state = {"model": into}
    read_checkpoint(state, tmp_path, no_dist=True)

    expected = {**SAVED, "cast": SAVED["cast"].to(torch.bfloat16)}
    for name, value in expected.items():
        got = state["model"][name]
        assert torch.equal(got, value) if isinstance(value, torch.Tensor) else got == value, name
    # torch's reader gets the non-tensor items and the one saved tensor that is not one contiguous run
    # (torch.save keeps a transposed view's strides), or everything where torch does not say where data is
    assert sorted(handed_on) == (["model.name", "model.step", "model.transposed"] if offsets else
                                 sorted(f"model.{name}" for name in SAVED))


def test_a_slice_of_a_saved_tensor_is_read_from_its_rows(tmp_path, handed_on):
    """What a resume on another number of ranks reads: part of a saved tensor. Rows (a slice of dim 0)
    are one run of the file, read directly from their offset; a slice of columns is not, and goes to
    torch's reader."""
    saved = torch.arange(48.0).reshape(6, 8)
    dcp.save({"w": saved}, checkpoint_id=tmp_path, no_dist=True)
    reader = CheckpointReader(tmp_path)
    metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, is_coordinator=True)
    rows, columns = torch.zeros(3, 8), torch.zeros(6, 5)
    planner = DefaultLoadPlanner()
    planner.set_up_planner({"rows": rows, "columns": columns}, metadata, is_coordinator=True)
    chunk = MetadataIndex("w", [0, 0], 0)
    plan = LoadPlan([ReadItem(LoadItemType.TENSOR, MetadataIndex("rows", [0, 0], 0), [0, 0], chunk, [2, 0], [3, 8]),
                     ReadItem(LoadItemType.TENSOR, MetadataIndex("columns", [0, 0], 0), [0, 0], chunk, [0, 3], [6, 5])])
    reader.read_data(plan, planner).wait()
    assert torch.equal(rows, saved[2:5]) and torch.equal(columns, saved[:, 3:])
    assert handed_on == ["columns"]
