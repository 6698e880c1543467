"""The package's import graph: no circles, and the runtime's arrows point down.

Edges are the package's own modules that a module imports at module level
(``import x``, ``from x import y``, relative ones resolved; ``from . import
y`` counts ``y`` when it is a module). Imports inside functions are ignored:
they run after every module has loaded, which is how the plugin's cheap entry
points defer heavy ones. A package's ``__init__`` is not counted as imported
by its submodules (Python runs it first, but nothing there is read).
"""

import ast
import pathlib

import llm_executorch_mlx

ROOT = pathlib.Path(llm_executorch_mlx.__file__).parent
PACKAGE = "llm_executorch_mlx"
RUNTIME = f"{PACKAGE}.runtime"

# Within the runtime, what each part may import (besides itself and the leaves).
# (quantized_kv: the type of a quantized history, which the cache makes and
# the CPU kernels read)
LEAVES = {f"{RUNTIME}.errors", f"{RUNTIME}.dtypes", f"{RUNTIME}.steps", f"{RUNTIME}.quantized_kv"}
LAYERS = {  # part -> the parts below it
    f"{RUNTIME}.pte": set(),
    f"{RUNTIME}.cpu": set(),
    f"{RUNTIME}.gpu": set(),
    f"{RUNTIME}.plan": {f"{RUNTIME}.cpu", f"{RUNTIME}.gpu"},  # what the ops read: below the interpreter
    f"{RUNTIME}.interp": {f"{RUNTIME}.pte", f"{RUNTIME}.cpu", f"{RUNTIME}.gpu", f"{RUNTIME}.plan"},
}


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, pathlib.Path]:
    return {module_name(p): p for p in ROOT.rglob("*.py")}


def imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The package's modules ``name`` imports at module level."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.parse(path.read_text()).body:  # module level only
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            submodules = {f"{base}.{a.name}" for a in node.names} & known
            found |= submodules
            if len(submodules) < len(node.names):  # some name is defined in ``base`` itself
                found.add(base)
    return {m for m in found if m in known and m != name}


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports(name, path, set(found)) for name, path in found.items()}


def test_no_module_imports_itself_through_others():
    edges = graph()
    state: dict[str, str] = {}
    circles = []

    def visit(name, trail):
        state[name] = "open"
        for other in sorted(edges[name]):
            if state.get(other) == "open":
                circles.append(trail[trail.index(other):] + [other])
            elif other not in state:
                visit(other, trail + [other])
        state[name] = "done"

    for name in sorted(edges):
        if name not in state:
            visit(name, [name])
    assert not circles, "\n".join(" -> ".join(c) for c in circles)


def part_of(name: str) -> str | None:
    return next((p for p in LAYERS if name == p or name.startswith(p + ".")), None)


def test_the_runtime_knows_nothing_of_llm_and_its_parts_import_only_downward():
    wrong = []
    for name, targets in graph().items():
        if not name.startswith(RUNTIME):
            continue
        for target in targets:
            if not target.startswith(RUNTIME):  # text, plugin, commands, registry...
                wrong.append(f"{name} -> {target}")
                continue
            if name in LEAVES and target not in LEAVES:
                wrong.append(f"{name} -> {target} (a leaf imports nothing above it)")
            here, there = part_of(name), part_of(target)
            if here is None or target in LEAVES or there == here:
                continue  # the top of the runtime may import any part
            if there is None or there not in LAYERS[here]:
                wrong.append(f"{name} -> {target} (upward)")
    assert not wrong, "\n".join(sorted(wrong))


def test_the_check_sees_relative_imports():
    edges = graph()
    assert f"{RUNTIME}.interp.int32" in edges[f"{RUNTIME}.interp.ops.shape"]  # from ..int32 import
    assert f"{RUNTIME}.pte._schema.mlx_delegate" in edges[f"{RUNTIME}.interp.ops.creation"]  # from ...pte._schema import mlx_delegate
    assert f"{RUNTIME}.program" in edges[RUNTIME]  # from .program import, in an __init__
