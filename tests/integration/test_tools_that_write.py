"""Tools that write (sft.export, sft.plot, the run's own export) never remove or overwrite what they
did not create: an existing non-empty output is refused in one line, and no `.tmp` is left."""

import os

import pytest

from helpers import file_tree, run_cli, run_demo
from sft import atomic


@pytest.fixture(scope="module")
def finished(tmp_path_factory, demo_data):
    out = tmp_path_factory.mktemp("writers")
    run_demo(demo_data, out, "run", "train.max_steps=2", "eval.every_steps=0", "checkpoint.export_hf=false")
    run_demo(demo_data, out, "other", "train.max_steps=1", "eval.every_steps=0", "checkpoint.export_hf=false")
    return out


@pytest.mark.slow
@pytest.mark.parametrize("target", ["run", ".", "run/metrics.jsonl"])
def test_export_into_an_existing_directory_or_file_is_one_line_and_loses_nothing(finished, target, capsys):
    """The reported case: `python -m sft.export runs/x/checkpoints/step-2 runs/x` deleted the run."""
    from sft.export import main

    before = file_tree(finished)
    out = finished / target
    status, _, err = run_cli(main, [str(finished / "run" / "checkpoints" / "step-2"), str(out)], capsys)
    assert status == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"error: cannot export to {out}: {out}") and "give a new directory" in err
    assert file_tree(finished) == before


@pytest.mark.slow
def test_export_into_a_new_directory_from_anywhere(finished, tmp_path, monkeypatch, capsys):
    from sft.export import main

    monkeypatch.chdir(tmp_path)  # a relative checkpoint path and output, from another directory
    checkpoint = os.path.relpath(finished / "run" / "checkpoints" / "step-2")
    status, out, err = run_cli(main, [checkpoint, "new/export"], capsys)
    assert status == 0, err
    assert (tmp_path / "new" / "export" / "config.json").is_file() and not (tmp_path / "new" / "export.tmp").exists()
    assert not (tmp_path / "new" / "export" / atomic.PARTIAL).exists()


@pytest.mark.slow
def test_plot_replaces_only_its_own_png(finished, capsys):
    from sft.plot import main

    run = finished / "other"

    def contents() -> dict[str, bytes]:  # everything in the run directory but the plot
        return {str(path.relative_to(run)): path.read_bytes() if path.is_file() else b"<dir>"
                for path in sorted(run.rglob("*")) if path.name != "curves.png"}

    before = contents()
    for _ in range(2):  # a second plot rewrites curves.png, atomically
        status, _, err = run_cli(main, [str(run)], capsys)
        assert status == 0, err
    assert (run / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert contents() == before  # nothing else written, replaced or left behind (no curves.png.tmp)
