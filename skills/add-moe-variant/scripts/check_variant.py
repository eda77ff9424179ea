"""Judge a new MoE / attention variant: the architecture rules, proof that the variant does
something, then validate-correctness with it switched on. Prints PASS or FAIL.

    python skills/add-moe-variant/scripts/check_variant.py --rules-only                  # static rules (seconds)
    python skills/add-moe-variant/scripts/check_variant.py --family qwen3_moe \\
        --set model.topk_mass=0.5                                                       # a variant, switched on

Stages, in order (--fail-fast stops at the first that fails; --rules-only runs the first,
--no-validate the first two):
  rules   static, over pithtrain/models/:
          single-device  model files import nothing from torch.distributed and never ask for ranks or meshes
          no-registry    no registration decorators, globals()/eval/exec/import_module lookups; FAMILIES in
                         models/__init__.py stays one literal dict
          config-field   a variant is a config field of an existing family, not a copied file: every file in
                         models/ (subfolders included) is a shared file (__init__, common, balance, hub, init) or a family in
                         FAMILIES; every --set key is a field of that family's config, and some test under
                         tests/ sets or names it as a config key: model.<field> (an override, a ConfigError
                         message) or <field>= (a keyword argument)
          budget         every file in models/ stays <= 800 lines; family files keep the shape-suffix legend
  effect  the variant must act: the family's default tiny model is built twice from the same weights,
          without and with the model.* overrides, and compared at every condition of SEEDS x
          ROUTER_SCALES (each router's weights scaled: x1 is the near-uniform router of a fresh
          init, where a threshold on router probabilities never fires; x8 and x64 are peaked
          routers, like trained ones). Compared: eval logits, train-mode gradients (the
          load-balancing loss included) and the routing statistics read from every MoE block's
          router outputs: experts per token (mean, min, max), the dropped-slot share (slots of
          weight 0) and the worst per-layer expert load (max / mean). FAIL when nothing differs
          anywhere (a no-op), or when a router breaks the contract the dispatchers rely on:
          (logits_TE, probs_TE, w_TA, idx_TA) with idx_TA int64 in [0, num_experts), w_TA the same shape, finite.
  validate  validate.py --quick --family F --set ...: parity with transformers with the variant at its
          default, grouped == loop, and a 30-step run with the variant on whose loss falls and stays finite.
Exit status 0 on PASS, 1 on FAIL.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import math
import re
import subprocess
import sys
from pathlib import Path

import torch

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
        if f.parent != MODELS or (f.stem not in ("__init__", "common", "balance", "hub", "init") and f.stem not in families):
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
# Effect: the variant against the base model, same weights, where a variant can act

SEEDS = (0, 1)
ROUTER_SCALES = (1.0, 8.0, 64.0)
EFFECT_MODEL = {"num_layers": 2}  # the family's default widths otherwise: 8 experts, top-2
BATCH, SEQ = 2, 32
RTOL = 1e-6  # a difference below this (relative to the base's largest value) is rounding, not an effect


def model_configs(family: str, sets: list[str]):
    """(base, variant) configs: the family defaults (EFFECT_MODEL), and the same plus the model.* sets."""
    from pithtrain.config import apply_override, config_from_dict

    raw = {"model": {"family": family, **EFFECT_MODEL}}
    variant = {"model": dict(raw["model"])}
    for s in sets:
        apply_override(variant, s)
    return (config_from_dict(raw, "base", cross_checks=False).model,
            config_from_dict(variant, "--set", cross_checks=False).model)


def moe_blocks(model) -> list:
    return [m for m in model.modules() if hasattr(m, "route") and hasattr(m, "num_experts")]


def record_routes(model) -> list:
    """Wrap every MoE block's `route` (on the instance) so each call appends (block, its outputs)."""
    log = []
    for m in moe_blocks(model):
        def wrapped(x_TD, m=m, route=m.route):
            out = route(x_TD)
            log.append((m, out))
            return out
        m.route = wrapped
    return log


def contract_problems(m, out, T: int) -> list[str]:
    """What both dispatchers (LocalDispatcher, the expert-parallel one) rely on from a router."""
    if not (isinstance(out, tuple) and len(out) == 4 and all(isinstance(t, torch.Tensor) for t in out)):
        return ["route must return four tensors (logits_TE, probs_TE, w_TA, idx_TA)"]
    _, probs_TE, w_TA, idx_TA = out
    bad = []
    if idx_TA.dtype != torch.int64 or idx_TA.dim() != 2 or idx_TA.shape[0] != T:
        bad.append(f"idx_TA must be int64 of shape (T={T}, A), got {idx_TA.dtype} {tuple(idx_TA.shape)}")
    elif idx_TA.numel() and not (0 <= int(idx_TA.min()) and int(idx_TA.max()) < m.num_experts):
        bad.append(f"idx_TA holds {int(idx_TA.min())}..{int(idx_TA.max())}: every id must be in "
                   f"[0, {m.num_experts}); drop a slot with weight 0 and a valid id (-1 breaks both dispatchers)")
    if w_TA.shape != idx_TA.shape:
        bad.append(f"w_TA has shape {tuple(w_TA.shape)}, idx_TA {tuple(idx_TA.shape)}: one weight per slot")
    elif not torch.isfinite(w_TA).all():
        bad.append("w_TA is not finite")
    if probs_TE.shape != (T, m.num_experts):
        bad.append(f"probs_TE must be (T, E) = ({T}, {m.num_experts}), got {tuple(probs_TE.shape)}")
    return bad


def routing_stats(log) -> dict:
    """Experts per token (kept slots: weight != 0) mean / min / max over tokens and layers, the share
    of dropped slots, and the worst layer's expert load max / mean over kept slots."""
    per_token, dropped, slots, worst = [], 0, 0, 1.0
    for m, (_, _, w_TA, idx_TA) in log:
        keep_TA = w_TA.detach() != 0
        per_token.append(keep_TA.sum(-1))
        dropped, slots = dropped + int((~keep_TA).sum()), slots + keep_TA.numel()
        load_E = torch.bincount(idx_TA[keep_TA], minlength=m.num_experts).double()
        worst = max(worst, float(load_E.max() / load_E.mean().clamp(min=1e-9)))
    k = torch.cat(per_token).double() if per_token else torch.zeros(1)
    return {"mean": float(k.mean()), "min": int(k.min()), "max": int(k.max()),
            "dropped": dropped / max(slots, 1), "load": worst}


def run_condition(cfg, state: dict, scale: float, ids_BS, labels_BS):
    """One model at one condition: (logits, {param: grad}, routing stats, contract problems)."""
    from pithtrain.models import build_model

    model = build_model(cfg)
    own = model.state_dict()
    model.load_state_dict({k: v for k, v in state.items() if k in own and own[k].shape == v.shape}, strict=False)
    with torch.no_grad():  # peak (or flatten) every router: its Linear(s) to num_experts logits
        for m in moe_blocks(model):
            for lin in m.children():
                if isinstance(lin, torch.nn.Linear) and lin.out_features == m.num_experts:
                    for p in lin.parameters():
                        p.mul_(scale)
    log = record_routes(model)
    model.eval()
    try:
        with torch.no_grad():
            logits = model(ids_BS).float()
        n_eval = len(log)  # the eval forward's router calls, one per MoE block
        model.train()
        model(ids_BS, labels_BS=labels_BS).backward()
    except Exception as e:  # e.g. an id a dispatcher cannot take: say why, not a traceback
        bad = sorted({p for m, out in log for p in contract_problems(m, out, ids_BS.numel())})
        return None, None, None, bad or [f"the forward / backward raised {type(e).__name__}: {e}"]
    bad = sorted({p for m, out in log for p in contract_problems(m, out, ids_BS.numel())})
    stats = routing_stats(log[:n_eval]) if not bad else None
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits, grads, stats, bad


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12)) if a.shape == b.shape else math.inf


def effect(family: str, sets: list[str]) -> tuple[bool, list[str]]:
    """(ok, lines to print): does the variant change logits, gradients or routing anywhere?"""
    from pithtrain.models import build_model

    model_sets = [s for s in sets if s.split("=", 1)[0].startswith("model.")]
    if not model_sets:
        return True, ["effect: SKIP (no --set model.X: nothing to compare with the base model)"]
    try:
        base_cfg, var_cfg = model_configs(family, model_sets)
    except ValueError as e:  # ConfigError: a bad value or key, named
        return False, [f"effect: FAIL: {e}"]
    what = " ".join(model_sets)
    lines = [f"effect of {what} on {family} ({base_cfg.num_layers} layers; base: the same weights without it)",
             f"  {'condition':<18} {'logits':>9} {'grads':>9}   experts/token mean min max   dropped   load"]
    acted, broken = [], []
    for seed in SEEDS:
        g = torch.Generator().manual_seed(seed)
        ids_BS = torch.randint(0, base_cfg.vocab_size, (BATCH, SEQ), generator=g)
        labels_BS = torch.randint(0, base_cfg.vocab_size, (BATCH, SEQ), generator=g)
        torch.manual_seed(seed)
        state = build_model(base_cfg).state_dict()
        for scale in ROUTER_SCALES:
            name = f"seed {seed} router x{scale:g}"
            b_logits, b_grads, b_stats, b_bad = run_condition(base_cfg, state, scale, ids_BS, labels_BS)
            v_logits, v_grads, v_stats, v_bad = run_condition(var_cfg, state, scale, ids_BS, labels_BS)
            broken += [f"{name}: {p}" for p in v_bad]
            if b_bad or v_bad:
                lines.append(f"  {name:<18} router contract broken")
                continue
            d_logits = rel_diff(v_logits, b_logits)
            d_grads = max((rel_diff(v_grads[n], b_grads[n]) for n in b_grads if n in v_grads), default=0.0)
            if set(v_grads) != set(b_grads):
                d_grads = math.inf
            if d_logits > RTOL or d_grads > RTOL or v_stats != b_stats:
                acted.append(name)
            lines.append(f"  {name:<18} {d_logits:9.2e} {d_grads:9.2e}   "
                         f"{b_stats['mean']:.2f} {b_stats['min']} {b_stats['max']} -> "
                         f"{v_stats['mean']:.2f} {v_stats['min']} {v_stats['max']}   "
                         f"{100 * b_stats['dropped']:3.0f}% -> {100 * v_stats['dropped']:3.0f}%   "
                         f"{b_stats['load']:.2f} -> {v_stats['load']:.2f}")
    lines.append("  (logits, grads: largest difference relative to the base; dropped: slots of weight 0; "
                 "load: worst layer's max / mean expert load)")
    if broken:
        lines += [f"  problem: router contract: {p}" for p in sorted(set(broken))]
        return False, lines + ["effect: FAIL (a router output the dispatchers cannot take)"]
    n = len(SEEDS) * len(ROUTER_SCALES)
    if not acted:
        return False, lines + [
            f"effect: FAIL: {what} is a no-op: logits, gradients and routing statistics equal the base "
            f"model's at all {n} conditions (seeds {', '.join(map(str, SEEDS))}; routers scaled "
            f"x{', x'.join(f'{s:g}' for s in ROUTER_SCALES)}). Check that the value reaches the code "
            "(config field -> module attribute -> forward) and that it can act at these conditions."]
    return True, lines + [f"effect: PASS (acts at {len(acted)} of {n} conditions)"]


# ---------------------------------------------------------------------------------------------
# Entry point


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", default="qwen3_moe", help="the family the variant belongs to")
    p.add_argument("--set", action="append", default=[], metavar="K=V",
                   help="the variant's switch, e.g. model.topk_mass=0.5 (repeatable)")
    p.add_argument("--rules-only", action="store_true", help="static rules only (no model, no training, no tests)")
    p.add_argument("--no-validate", action="store_true", help="rules and effect only (seconds), not validate.py")
    p.add_argument("--fail-fast", action="store_true", help="stop at the first stage that fails")
    args = p.parse_args(argv)

    from pithtrain.models import FAMILIES

    if args.family not in FAMILIES:
        sys.exit(f"error: unknown family {args.family!r} (families: {', '.join(FAMILIES)})")
    problems = rule_problems(FAMILIES) + override_problems(args.family, args.set, FAMILIES)
    print(f"architecture rules: {len(problems)} problem(s)")
    for msg in problems:
        print(f"  problem: {msg}")
    ok = not problems
    if not args.rules_only and (ok or not args.fail_fast):
        acted, lines = effect(args.family, args.set)
        print("\n".join(lines), flush=True)
        ok = ok and acted
    if not (args.rules_only or args.no_validate) and (ok or not args.fail_fast):
        cmd = [sys.executable, str(VALIDATE), "--quick", "--family", args.family]
        cmd += [a for s in args.set for a in ("--set", s)]
        print("+ " + " ".join(cmd), flush=True)
        ok = subprocess.run(cmd, cwd=ROOT).returncode == 0 and ok
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
