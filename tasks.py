"""Invoke tasks: the one command surface of PithTrain (`invoke --list`).

    invoke train                 # embedded default recipe, native runtime
    invoke test                  # the CPU test suite (what CI runs)
"""

from __future__ import annotations

import shlex
import sys

from invoke import task


def _py(c, args: str, **kw):
    return c.run(f"{shlex.quote(sys.executable)} {args}", pty=False, **kw)


@task(help={"recipe": "recipe YAML file or embedded recipe name (default: embedded default)",
            "set": "override section.key=value (repeatable)"},
      iterable=["set"])
def train(c, recipe="", set=None):
    """Train from a recipe (no arguments: the tiny embedded default on CPU or the visible GPU)."""
    args = " ".join(shlex.quote(a) for a in ([recipe] if recipe else []) + list(set or []))
    _py(c, f"-m pithtrain.train {args}")


@task(help={"k": "only tests matching this pytest -k expression",
            "gpu": "run the GPU tests (pytest -m gpu) instead of the CPU suite"})
def test(c, k="", gpu=False):
    """Run the test suite (CPU by default; --gpu on a CUDA machine)."""
    args = ["-m", "gpu"] if gpu else []
    if k:
        args += ["-k", k]
    result = _py(c, "-m pytest " + " ".join(shlex.quote(a) for a in args), warn=True)
    if result.exited not in (0, 5):  # 5: no tests collected
        sys.exit(result.exited)
