"""The checkpoint reader: a DCP checkpoint's tensors read straight into their destinations, equal to
torch's own reader, with what it cannot read directly handed to torch's reader."""

import torch
import torch.distributed.checkpoint as dcp

from sft.checkpoint.reader import read_checkpoint


def test_tensors_are_read_into_their_destinations_as_torch_reads_them(tmp_path, monkeypatch):
    torch.manual_seed(0)
    wide = torch.randn(6, 8)
    saved = {"weight": torch.randn(64, 32), "bf16": torch.randn(5, 7).to(torch.bfloat16), "ids": torch.arange(9),
             "scalar": torch.tensor(3.5), "rows": wide[2:5],  # a view into a larger storage: its own rows
             "transposed": wide.t(), "cast": torch.randn(4, 4), "step": 7, "name": "adamw"}
    dcp.save({"model": saved}, checkpoint_id=tmp_path, no_dist=True)

    handed_on = []
    torch_reader = dcp.FileSystemReader.read_data
    monkeypatch.setattr(dcp.FileSystemReader, "read_data",
                        lambda self, plan, planner: handed_on.extend(i.dest_index.fqn for i in plan.items)
                        or torch_reader(self, plan, planner))
    into = {name: torch.zeros_like(value) if isinstance(value, torch.Tensor) else None for name, value in saved.items()}
    into["cast"] = torch.zeros(4, 4, dtype=torch.bfloat16)  # the destination's dtype wins, as in torch's reader
    into["transposed"] = torch.zeros(6, 8).t()  # a strided destination
    state = {"model": into}
    read_checkpoint(state, tmp_path, no_dist=True)

    expected = {**saved, "cast": saved["cast"].to(torch.bfloat16)}
    for name, value in expected.items():
        got = state["model"][name]
        assert torch.equal(got, value) if isinstance(value, torch.Tensor) else got == value, name
    # torch's reader gets only the non-tensor items and the one saved view that is not one contiguous run
    # (torch.save keeps a view's strides); the rows of a larger storage are read from their offset in it.
    assert sorted(handed_on) == ["model.name", "model.step", "model.transposed"]
