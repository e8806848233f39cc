"""The configuration reference, generated from the dataclasses' field docstrings: printed by
`python -m sft.config`, kept in docs/configuration.md between its markers."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import typing
from pathlib import Path

from sft.config.schema import Config


def field_docs(cls: type) -> dict[str, str]:
    """Map field name -> the docstring literal that follows it in the class body."""
    docs: dict[str, str] = {}
    body = ast.parse(inspect.getsource(cls)).body[0].body
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def reference_markdown() -> str:
    """The config reference table (docs/configuration.md), generated from the dataclasses."""
    lines = []
    for section in dataclasses.fields(Config):
        cls = typing.get_type_hints(Config)[section.name]
        docs = field_docs(cls)
        lines += [f"### `{section.name}`", "", "| key | default | meaning |", "|---|---|---|"]
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            lines.append(f"| `{section.name}.{f.name}` | `{default!r}` | {docs.get(f.name, '')} |")
        lines.append("")
    return "\n".join(lines)


README_MARKERS = ("<!-- config-reference:start -->\n", "<!-- config-reference:end -->")


def update_readme(path: Path) -> None:
    """Rewrite the config reference between the markers of `path` (docs/configuration.md) from the dataclasses."""
    text = path.read_text()
    start, end = text.index(README_MARKERS[0]) + len(README_MARKERS[0]), text.index(README_MARKERS[1])
    path.write_text(text[:start] + reference_markdown() + text[end:])
