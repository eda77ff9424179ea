"""The quick tier (`invoke test --quick`, pytest -m quick: about a minute on 2 cores) touches every
pithtrain module: each is imported by name in a test marked quick, inside the test, in a helper or
fixture of its file that the test reaches, or at the top of its file and used by name in one of
those. A new module that no quick test reaches fails here: mark its contract's test quick."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from test_imports import import_graph

pytestmark = pytest.mark.quick
TESTS = Path(__file__).resolve().parent


def triton_only(module: str) -> bool:
    """A Triton kernel file (imports triton at its top): it cannot load on CPU; its tests are gpu."""
    path = TESTS.parent / (module.replace(".", "/") + ".py")
    return path.is_file() and any(isinstance(n, ast.Import) and any(a.name == "triton" for a in n.names)
                                  for n in ast.parse(path.read_text()).body)


def is_quick(marks: list[ast.expr]) -> bool:
    return any(isinstance(m, ast.Attribute) and m.attr == "quick" for m in
               (d for mark in marks for d in ([*mark.elts] if isinstance(mark, (ast.List, ast.Tuple)) else [mark])))


def quick_reach(tree: ast.Module, modules: set[str]) -> dict[str, set[str]]:
    """quick test name -> the modules it reaches (see the docstring above)."""
    def imported(node) -> dict[str, str]:  # bound name -> module, for one import statement
        if isinstance(node, ast.Import):
            return {(a.asname or a.name.split(".")[0]): a.name for a in node.names if a.name in modules}
        if isinstance(node, ast.ImportFrom) and node.module in modules:
            return {(a.asname or a.name): f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules
                    else node.module for a in node.names}
        return {}

    top = {k: v for node in tree.body for k, v in imported(node).items()}
    funcs = {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)}
    file_quick = any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
                     and is_quick([n.value]) for n in tree.body)
    out = {}
    for name, f in funcs.items():
        if not name.startswith("test_") or not (file_quick or is_quick(f.decorator_list)):
            continue
        reach, todo = set(), [name, *(a.arg for a in f.args.args if a.arg in funcs)]
        while todo:
            n = todo.pop()
            if n not in reach:
                reach.add(n)
                todo += [x.id for x in ast.walk(funcs[n]) if isinstance(x, ast.Name) and x.id in funcs]
        mods = set()
        for n in reach:
            for node in ast.walk(funcs[n]):
                mods |= set(imported(node).values())
                if isinstance(node, ast.Name) and node.id in top:
                    mods.add(top[node.id])
        out[name] = mods | {".".join(m.split(".")[:i]) for m in mods for i in range(1, m.count(".") + 1)}
    return out


def quick_coverage(test_files, modules: set[str]) -> dict[str, set[str]]:
    """test file name -> the modules its quick tests reach."""
    return {p.name: set().union(*quick_reach(ast.parse(p.read_text()), modules).values())
            for p in test_files}


def test_every_pithtrain_module_is_reached_by_a_quick_test():
    modules = set(import_graph())
    gpu_only = {m for m in modules if triton_only(m)}
    assert "pithtrain.kernels.swiglu" in gpu_only and "pithtrain.kernels.linear_ce" not in gpu_only
    covered = set().union(*quick_coverage(sorted(TESTS.glob("test_*.py")), modules).values())
    missing = sorted(modules - covered - gpu_only)
    assert not missing, f"no quick test reaches {', '.join(missing)}: mark a test of its contract @pytest.mark.quick"


def test_the_coverage_check_sees_helpers_fixtures_and_misses(tmp_path):
    mods = {"pithtrain", "pithtrain.a", "pithtrain.b", "pithtrain.c", "pithtrain.d"}
    (tmp_path / "test_x.py").write_text(
        "import pytest\nfrom pithtrain import a\nfrom pithtrain.b import thing\n\n"
        "def helper():\n    from pithtrain import c\n\n"
        "@pytest.fixture\ndef fx():\n    return thing\n\n"
        "@pytest.mark.quick\ndef test_one(fx):\n    helper()\n\n"
        "def test_slow():\n    from pithtrain import d\n    a.f()\n")
    got = quick_coverage([tmp_path / "test_x.py"], mods)["test_x.py"]
    assert got == {"pithtrain", "pithtrain.b", "pithtrain.c"}  # a: imported, used only by a slow test
