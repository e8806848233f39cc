"""The house as README.md's "Design" describes it: packages in floors, each importing only from the
floors below it; sizes that a newcomer reads in an afternoon; the sft imports of a module sorted."""

from __future__ import annotations

import ast
from pathlib import Path

from helpers import REPO

# Bottom to top (README.md, "Design"); a unit is a package of sft/ or a module directly in it.
FLOORS = [
    {"errors", "atomic", "profiling", "rng"},
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
# sft/models/ grew by the vision tower (sft/models/vision.py, issue #61) from its 1,600 lines
MAX_LINES = {"module": 400, "function": 80, "module docstring": 30, "sft/models/": 1750}
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


# Attributes assigned on these are on our own objects: not patch points (docs/patch-points.md)
OWN_OBJECTS = {"self", "cls", "ctx", "error", "value", "cfg"}


def _patch_points(tree: ast.Module, path: str) -> set[str]:
    """`path:function` of every place in `tree` that assigns or deletes an attribute of an object not in
    OWN_OBJECTS (or an item of one: a module's _parameters), or calls setattr, delattr, register_parameter,
    register_buffer or a `.register(...)` (transformers' AttentionInterface; not atexit's)."""
    found = set()

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = where
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                inner = f"{where}.{child.name}" if where else child.name
            targets = (child.targets if isinstance(child, ast.Assign) else
                       [child.target] if isinstance(child, ast.AugAssign | ast.AnnAssign) else [])
            if isinstance(child, ast.Delete):
                targets = child.targets
            for target in (t for top in targets for t in ast.walk(top)):
                # obj.attr = / del obj.attr, and obj.attr[key] = (a module's _parameters, _buffers)
                store = isinstance(target, ast.Attribute) and isinstance(target.ctx, ast.Store | ast.Del)
                store |= (isinstance(target, ast.Subscript) and isinstance(target.ctx, ast.Store | ast.Del)
                          and isinstance(target.value, ast.Attribute))
                if store:
                    root = target.value if isinstance(target, ast.Subscript) else target
                    while isinstance(root, ast.Attribute | ast.Subscript):
                        root = root.value
                    if not (isinstance(root, ast.Name) and root.id in OWN_OBJECTS):
                        found.add(f"{path}:{where}")
            if isinstance(child, ast.Call):
                called = ast.unparse(child.func)
                if called in ("setattr", "object.__setattr__", "delattr") or (
                        called.endswith((".register", ".register_parameter", ".register_buffer"))
                        and called != "atexit.register"):
                    found.add(f"{path}:{where}")
            visit(child, inner)

    visit(tree, "")
    return found


def test_every_patch_point_is_listed():
    """A place that changes an object of torch, transformers or torchao (or the model they built) is a
    row of docs/patch-points.md, and every row names a place that still does."""
    in_code = set().union(*(_patch_points(tree, str(path.relative_to(REPO))) for path, tree in SOURCES.items()))
    table = (REPO / "docs" / "patch-points.md").read_text()
    listed = {line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| sft/")}
    assert sorted(in_code - listed) == [], "list these in docs/patch-points.md (what they change, the kind, why)"
    assert sorted(listed - in_code) == [], "these rows of docs/patch-points.md name no patch point any more"


def test_every_bench_stage_has_its_own_name():
    """scripts/bench_gpu.sh runs the first `case` branch of a stage's name: a second stage of the same
    name would never run (and its runs' device time would go to the first)."""
    import re
    from collections import Counter

    branches = re.findall(r"^    ([a-z0-9|]+)\)", (REPO / "scripts/bench_gpu.sh").read_text(), re.MULTILINE)
    stages = [name for branch in branches for name in branch.split("|")]
    assert {"startup", "acoffload", "longctx4", "summary"} <= set(stages)  # the parse finds them
    assert [name for name, count in Counter(stages).items() if count > 1] == []
