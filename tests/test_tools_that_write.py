"""Tools that write (sft.export, sft.plot, the run's own export) never remove or overwrite what they
did not create: an existing non-empty output is refused in one line, and no `.tmp` is left."""

import os

import pytest

from helpers import run_cli, run_demo
from sft import atomic


def tree(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("what", ["a user's file", "a file in the way", "a .tmp of someone else's"])
def test_a_directory_write_never_replaces_what_is_there(tmp_path, what):
    out = tmp_path / "out"
    if what == "a user's file":
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    elif what == "a file in the way":
        out.write_text("mine")
    else:
        (tmp_path / "out.tmp").mkdir()
        (tmp_path / "out.tmp" / "notes.txt").write_text("mine")
    before = tree(tmp_path)
    with pytest.raises(atomic.PathInTheWay):
        with atomic.directory(out) as tmp:
            (tmp / "written").write_text("new")
    assert tree(tmp_path) == before


def test_a_directory_write_takes_an_empty_directory_and_cleans_up_after_itself(tmp_path):
    out = tmp_path / "out"
    out.mkdir()  # made beforehand by the user: empty, so nothing is lost
    with atomic.directory(out) as tmp:
        (tmp / "a").write_text("1")
    assert tree(tmp_path) == {"out/a": b"1"}
    # A failing write leaves nothing; an interrupted one's leftover (our mark in it) is taken over.
    with pytest.raises(KeyError):
        with atomic.directory(tmp_path / "failed") as tmp:
            raise KeyError("a bug")
    assert sorted(os.listdir(tmp_path)) == ["out"]
    (tmp_path / "killed.tmp").mkdir()
    (tmp_path / "killed.tmp" / atomic.PARTIAL).touch()
    (tmp_path / "killed.tmp" / "half").write_text("x")
    with atomic.directory(tmp_path / "killed") as tmp:
        (tmp / "b").write_text("2")
    assert tree(tmp_path / "killed") == {"b": b"2"} and not (tmp_path / "killed.tmp").exists()


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

    before = tree(finished)
    out = finished / target
    status, _, err = run_cli(main, [str(finished / "run" / "checkpoints" / "step-2"), str(out)], capsys)
    assert status == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"error: cannot export to {out}: {out}") and "give a new directory" in err
    assert tree(finished) == before


@pytest.mark.slow
def test_export_into_a_new_directory_from_anywhere(finished, tmp_path, monkeypatch, capsys):
    from sft.export import main

    monkeypatch.chdir(tmp_path)  # a relative checkpoint path and output, from another directory
    checkpoint = os.path.relpath(finished / "run" / "checkpoints" / "step-2")
    status, out, err = run_cli(main, [checkpoint, "new/export"], capsys)
    assert status == 0, err
    assert (tmp_path / "new" / "export" / "config.json").is_file() and not (tmp_path / "new" / "export.tmp").exists()
    assert not (tmp_path / "new" / "export" / atomic.PARTIAL).exists()


def test_plot_of_a_missing_run_is_one_line(tmp_path, capsys):
    from sft.plot import main

    status, _, err = run_cli(main, [str(tmp_path / "no-such-run")], capsys)
    assert status == 2 and err == f"error: {tmp_path / 'no-such-run'}: no metrics.jsonl there; give a run directory " \
                                  "(<train.output_dir>/<train.run_name>)\n"


@pytest.mark.slow
def test_plot_replaces_only_its_own_png(finished, capsys):
    from sft.plot import main

    for _ in range(2):  # a second plot rewrites curves.png, atomically
        status, _, err = run_cli(main, [str(finished / "other")], capsys)
        assert status == 0, err
    assert (finished / "other" / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert not (finished / "other" / "curves.png.tmp").exists()
