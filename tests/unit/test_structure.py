"""The house as README.md's "Design" describes it: packages in floors, each importing only from the
floors below it; sizes that a newcomer reads in an afternoon; the sft imports of a module sorted."""

from __future__ import annotations

import ast
from pathlib import Path

from helpers import REPO

# Bottom to top (README.md, "Design"); a unit is a package of sft/ or a module directly in it.
FLOORS = [
    {"errors", "atomic", "profiling"},
    {"distributed", "compile_cache"},
    {"config"},
    {"models"},
    {"hub"},
    {"adapters"},
    {"data"},
    {"parallel"},
    {"checkpoint"},
    {"export"},
    {"training"},
    {"plan", "chat", "plot"},
]
MAX_LINES = {"module": 400, "function": 80, "module docstring": 30, "sft/models/": 1600}
MAX_ARGUMENTS = 10

SOURCES = {path: ast.parse(path.read_text()) for path in sorted((REPO / "sft").rglob("*.py"))}


def unit(module: str) -> str:
    """sft.a.b -> a; the root package itself (sft, sft.__init__) -> sft."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] != "__init__" else "sft"


def imported_sft_modules(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, module) of every sft import in `tree`, at any depth (imports inside functions count)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "sft":
            found += [(node.lineno, node.module)]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name.split(".")[0] == "sft"]
    return found


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts)


def test_no_package_imports_one_above_it_or_beside_it():
    floor = {name: i for i, names in enumerate(FLOORS) for name in names}
    units = {unit(module_name(path)) for path in SOURCES} - {"sft"}
    assert units == set(floor), "give a new package or module of sft/ its floor here and in README.md's Design"
    wrong = []
    for path, tree in SOURCES.items():
        importer = unit(module_name(path))
        for line, module in imported_sft_modules(tree):
            imported = unit(module)
            if "sft" not in (importer, imported) and importer != imported and floor[imported] >= floor[importer]:
                wrong.append(f"{path.relative_to(REPO)}:{line} imports {module} (floor {floor[imported]} >= "
                             f"{floor[importer]})")
    assert wrong == []


def test_sizes_a_newcomer_reads():
    too_long = []
    for path, tree in SOURCES.items():
        name = path.relative_to(REPO)
        if (lines := len(path.read_text().splitlines())) > MAX_LINES["module"]:
            too_long.append(f"{name}: {lines} lines")
        if (doc := ast.get_docstring(tree, clean=False)) and len(doc.splitlines()) > MAX_LINES["module docstring"]:
            too_long.append(f"{name}: a docstring of {len(doc.splitlines())} lines (derivations go to docs/)")
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if (lines := node.end_lineno - node.lineno + 1) > MAX_LINES["function"]:
                too_long.append(f"{name}:{node.lineno} {node.name}: {lines} lines")
            arguments = [a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs]
            if len([a for a in arguments if a not in ("self", "cls")]) > MAX_ARGUMENTS:
                too_long.append(f"{name}:{node.lineno} {node.name}: {len(arguments)} arguments (group them)")
    models = sum(len(path.read_text().splitlines()) for path in SOURCES if "models" in path.parts)
    if models > MAX_LINES["sft/models/"]:
        too_long.append(f"sft/models/: {models} lines")
    assert too_long == []


def test_the_sft_imports_at_the_top_of_a_module_are_sorted():
    unsorted = []
    for path, tree in SOURCES.items():
        top = [node.module for node in tree.body
               if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "sft"]
        if top != sorted(top):
            unsorted.append(str(path.relative_to(REPO)))
    assert unsorted == []
