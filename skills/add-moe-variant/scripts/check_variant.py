"""Judge a new MoE / attention variant: the architecture rules, then validate-correctness with the
variant switched on. Prints PASS or FAIL.

    python skills/add-moe-variant/scripts/check_variant.py                       # rules + default model
    python skills/add-moe-variant/scripts/check_variant.py --family qwen3_moe \\
        --set model.router=dynamic --set model.router_threshold=0.5              # a variant, switched on

Rules (static, over pithtrain/models/):
  single-device  model files import nothing from torch.distributed and never ask for ranks or meshes
  no-registry    no registration decorators, globals()/eval/exec/import_module lookups; FAMILIES in
                 models/__init__.py stays one literal dict
  config-field   a variant is a config field of an existing family, not a copied file: every file in
                 models/ (subfolders included) is __init__.py, common.py or a family named in FAMILIES;
                 every --set key is a field of that family's config, and some test under tests/ sets or
                 names it as a config key: model.<field> (an override, a ConfigError message) or
                 <field>= (a keyword argument)
  budget         every file in models/ stays <= 800 lines; family files keep the shape-suffix legend
Then, with the --set overrides: validate.py --quick --family F (parity with transformers with the
variant at its default, grouped == loop, and a 30-step run with the variant on whose loss falls and
stays finite). Exit status 0 on PASS, 1 on FAIL.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
MODELS = ROOT / "pithtrain" / "models"
VALIDATE = ROOT / "skills" / "validate-correctness" / "scripts" / "validate.py"

MAX_LINES = 800
ALLOWED_DECORATORS = {"dataclass", "staticmethod", "classmethod", "property", "torch.no_grad",
                      "torch.compiler.disable", "torch.inference_mode", "functools.cache", "cache"}
FORBIDDEN_CALLS = {"globals", "eval", "exec", "import_module", "__import__", "get_rank",
                   "get_world_size", "init_process_group", "new_group", "init_device_mesh", "DeviceMesh"}


# ---------------------------------------------------------------------------------------------
# Static rules


def dotted(node) -> str:
    if isinstance(node, ast.Call):
        return dotted(node.func)
    if isinstance(node, ast.Attribute):
        return f"{dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else "?"


def rule_problems(families: dict) -> list[str]:
    out = []
    # rglob: a file in a subfolder is model code too, and must not escape the rules
    for f in sorted(MODELS.rglob("*.py")):
        rel, text = f.relative_to(ROOT), f.read_text()
        tree = ast.parse(text)
        if f.parent != MODELS or (f.stem not in ("__init__", "common") and f.stem not in families):
            out.append(f"config-field: {rel} is not a family in FAMILIES: make the variant a config field "
                       "of an existing family (or register a new family in the one literal FAMILIES dict)")
        n = len(text.splitlines())
        if n > MAX_LINES:
            out.append(f"budget: {rel} has {n} lines (> {MAX_LINES})")
        if f.stem in families and "legend" not in (ast.get_docstring(tree) or "").lower():
            out.append(f"budget: {rel}: the module docstring must point to the shape-suffix legend")
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names]
                if isinstance(node, ast.ImportFrom) and node.module:
                    # `from torch import distributed` names the module only as module + "." + alias
                    names = [node.module] + [f"{node.module}.{a}" for a in names]
                if any(n and n.startswith("torch.distributed") for n in names):
                    out.append(f"single-device: {rel}:{node.lineno} imports torch.distributed (parallelism "
                               "lives in pithtrain/distributed/)")
            elif isinstance(node, ast.Call) and dotted(node).split(".")[-1] in FORBIDDEN_CALLS:
                out.append(f"single-device/no-registry: {rel}:{node.lineno} calls {dotted(node)}()")
            elif isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
                for d in node.decorator_list:
                    if dotted(d) not in ALLOWED_DECORATORS:
                        out.append(f"no-registry: {rel}:{d.lineno} decorator @{dotted(d)} (choose by explicit "
                                   "import or the one literal mapping)")
    init = ast.parse((MODELS / "__init__.py").read_text())
    literal = [n for n in init.body if isinstance(n, ast.Assign) and any(
        isinstance(t, ast.Name) and t.id == "FAMILIES" for t in n.targets) and isinstance(n.value, ast.Dict)]
    if not literal:
        out.append("no-registry: pithtrain/models/__init__.py: FAMILIES must be one literal dict")
    return out


def override_problems(family: str, sets: list[str], families: dict) -> list[str]:
    out = []
    fields = {f.name for f in dataclasses.fields(families[family].config)}
    tests = "\n".join(p.read_text() for p in sorted((ROOT / "tests").glob("*.py")))
    for s in sets:
        key = s.split("=", 1)[0]
        section, _, name = key.partition(".")
        if section != "model":
            continue  # train./data. switches are not model variants
        if name not in fields:
            out.append(f"config-field: {key} is not a field of {families[family].config.__name__} "
                       f"(pithtrain/models/{family}.py)")
        # The field must be used as a config key, not merely appear as a word: 'router' is already
        # in the tests as HF's router weights, which says nothing about a new `router` switch.
        elif not re.search(rf"model\.{name}\b|\b{name}=", tests):
            out.append(f"config-field: no test under tests/ sets model.{name} (an override or a ConfigError "
                       f"message naming the key) or passes {name}= to the config: add a test for the variant")
    return out


# ---------------------------------------------------------------------------------------------
# Entry point


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", default="qwen3_moe", help="the family the variant belongs to")
    p.add_argument("--set", action="append", default=[], metavar="K=V",
                   help="the variant's switch, e.g. model.router=dynamic (repeatable)")
    p.add_argument("--rules-only", action="store_true", help="static rules only (no training, no tests)")
    args = p.parse_args(argv)

    from pithtrain.models import FAMILIES

    if args.family not in FAMILIES:
        sys.exit(f"error: unknown family {args.family!r} (families: {', '.join(FAMILIES)})")
    problems = rule_problems(FAMILIES) + override_problems(args.family, args.set, FAMILIES)
    print(f"architecture rules: {len(problems)} problem(s)")
    for msg in problems:
        print(f"  problem: {msg}")
    ok = not problems
    if not args.rules_only:
        cmd = [sys.executable, str(VALIDATE), "--quick", "--family", args.family]
        cmd += [a for s in args.set for a in ("--set", s)]
        print("+ " + " ".join(cmd), flush=True)
        ok = subprocess.run(cmd, cwd=ROOT).returncode == 0 and ok
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
