"""No import cycles among pithtrain's modules, function-level imports included: a cycle hidden by a
local import still couples two modules both ways (and breaks when the import moves to the top)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = ROOT, package: str = "pithtrain") -> dict[str, set[str]]:
    """module -> the package's modules it imports anywhere in its file. Importing a.b.c also runs
    the packages a and a.b (their __init__), unless the importer is inside them (then they are
    already being imported)."""
    files = {module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}
    graph = {}
    for mod, path in files.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{path}:{node.lineno}: write the import absolute (pithtrain.x)"
                base = node.module
                targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names}
        edges = set()
        for t in targets:
            parts = t.split(".")
            for n in range(1, len(parts) + 1):
                name = ".".join(parts[:n])
                if name in files and name != mod and not (mod + ".").startswith(name + "."):
                    edges.add(name)
        graph[mod] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (depth-first search, colouring)."""
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == "open":
                return stack[stack.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        state[m] = "done"
        stack.pop()
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


@pytest.mark.quick
def test_no_import_cycles_among_pithtrain_modules():
    graph = import_graph()
    assert len(graph) > 30 and "pithtrain.config" in graph["pithtrain.data"] | graph["pithtrain.train"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


# What each lower layer may import of the package (AGENTS.md's layers): operators nothing above them,
# model code no parallelism (single-device, the one `parallelize` step applies it).
LAYERS = {"pithtrain.kernels": ("pithtrain.kernels",), "pithtrain.models": ("pithtrain.models", "pithtrain.kernels")}


@pytest.mark.quick
def test_no_lower_layer_imports_a_higher_one_and_no_private_name_crosses_a_package():
    """kernels import only kernels, models only models and kernels (function-level imports too);
    and no module imports another module's private name (`_x`): a helper two modules share is
    public where it lives."""
    graph, upward, private = import_graph(), [], []
    for mod, deps in graph.items():
        for layer, allowed in LAYERS.items():
            if mod == layer or mod.startswith(layer + "."):
                upward += [f"{mod} -> {d}" for d in deps if d != "pithtrain" and not d.startswith(allowed)]
    for path in sorted((ROOT / "pithtrain").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module.startswith("pithtrain"):
                private += [f"{path.relative_to(ROOT)}: {node.module}.{a.name}" for a in node.names
                            if a.name.startswith("_")]
    assert not upward and not private, upward + private


def test_the_check_finds_a_cycle_hidden_in_a_function(tmp_path):
    pkg = tmp_path / "pithtrain"
    (pkg / "models").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "config.py").write_text("import yaml\n\ndef load():\n    from pithtrain.models import FAMILIES\n")
    (pkg / "models" / "__init__.py").write_text("from pithtrain.models import family\n")
    (pkg / "models" / "family.py").write_text("from pithtrain.models import common\n")
    (pkg / "models" / "common.py").write_text("def f():\n    from pithtrain import config\n")
    graph = import_graph(tmp_path)
    assert find_cycle(graph) == ["pithtrain.config", "pithtrain.models", "pithtrain.models.family",
                                 "pithtrain.models.common", "pithtrain.config"]
    (pkg / "models" / "common.py").write_text("import torch\n")  # the local import gone: no cycle
    assert find_cycle(import_graph(tmp_path)) is None
    # a submodule of a package whose __init__ imports the importer back is a cycle too
    (pkg / "models" / "common.py").write_text("from pithtrain.checkpoint.names import hub_name\n")
    (pkg / "checkpoint").mkdir()
    (pkg / "checkpoint" / "__init__.py").write_text("from pithtrain.checkpoint import hf\n")
    (pkg / "checkpoint" / "names.py").write_text("")
    (pkg / "checkpoint" / "hf.py").write_text("from pithtrain.models import FAMILIES\n")
    assert find_cycle(import_graph(tmp_path)) == ["pithtrain.checkpoint", "pithtrain.checkpoint.hf",
                                                  "pithtrain.models", "pithtrain.models.family",
                                                  "pithtrain.models.common", "pithtrain.checkpoint"]


def test_each_module_imports_first_in_a_fresh_interpreter():
    """Every module imports as the first pithtrain import of a process (one interpreter per module
    would be ~1 s each: every pithtrain module is dropped from sys.modules between imports, torch
    stays loaded). Triton-only kernels may lack Triton here; any other missing name fails."""
    code = """
import importlib, sys
for name in sys.argv[1:]:
    for m in [m for m in sys.modules if m == "pithtrain" or m.startswith("pithtrain.")]:
        del sys.modules[m]
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name != "triton" or not name.startswith("pithtrain.kernels."):
            raise
print("ok", len(sys.argv) - 1)
"""
    mods = sorted(import_graph())
    r = subprocess.run([sys.executable, "-c", code, *mods], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["ok", str(len(mods))], r.stderr[-3000:]
