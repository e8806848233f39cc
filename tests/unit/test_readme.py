"""The README's module table names every module of sft/ (a module added without a row fails here)."""

from __future__ import annotations

import re

from helpers import REPO


def listed_modules(readme: str) -> set[str]:
    """The paths the table's first column names: `sft/a/b.py`, then `c.py` for sft/a/c.py in the same
    cell, or a whole package `sft/plan/`."""
    listed = set()
    for line in readme.splitlines():
        if not line.startswith("| `sft/"):
            continue
        folder = ""
        for token in re.findall(r"`([^`]+)`", line.split(" | ")[0]):
            if token.startswith("sft/"):
                folder = token if token.endswith("/") else token.rsplit("/", 1)[0] + "/"
                listed.add(token)
            else:
                listed.add(folder + token)
    return listed


def test_every_module_of_sft_has_a_row_in_the_readme():
    listed = listed_modules((REPO / "README.md").read_text())
    packages = [path for path in listed if path.endswith("/")]
    modules = sorted(str(path.relative_to(REPO)) for path in (REPO / "sft").rglob("*.py") if path.name != "__init__.py")
    assert len(modules) > 50
    missing = [m for m in modules if m not in listed and not any(m.startswith(package) for package in packages)]
    assert missing == [], f"add a row to the README's module table for {missing}"
    assert [path for path in listed if not (REPO / path).exists()] == []  # no row for a module that is gone
