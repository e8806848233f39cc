"""Tools that write (sft.export, sft.plot, the run's own export) never remove or overwrite what they
did not create: an existing non-empty output is refused in one line, and no `.tmp` is left."""

import os

import pytest

from helpers import file_tree, run_cli
from sft import atomic


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
    before = file_tree(tmp_path)
    with pytest.raises(atomic.PathInTheWay):
        with atomic.directory(out) as tmp:
            (tmp / "written").write_text("new")
    assert file_tree(tmp_path) == before


def test_a_directory_write_takes_an_empty_directory_and_cleans_up_after_itself(tmp_path):
    out = tmp_path / "out"
    out.mkdir()  # made beforehand by the user: empty, so nothing is lost
    with atomic.directory(out) as tmp:
        (tmp / "a").write_text("1")
    assert file_tree(tmp_path) == {"out/a": b"1"}
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
    assert file_tree(tmp_path / "killed") == {"b": b"2"} and not (tmp_path / "killed.tmp").exists()


def test_plot_of_a_missing_run_is_one_line(tmp_path, capsys):
    from sft.plot import main

    status, _, err = run_cli(main, [str(tmp_path / "no-such-run")], capsys)
    assert status == 2 and err == f"error: {tmp_path / 'no-such-run'}: no metrics.jsonl there; give a run directory " \
                                  "(<train.output_dir>/<train.run_name>)\n"
