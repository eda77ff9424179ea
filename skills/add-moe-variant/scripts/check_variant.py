"""Judge a new MoE / attention variant: the architecture rules, proof that the variant does
something, then validate-correctness with it switched on. Prints PASS or FAIL.

    python skills/add-moe-variant/scripts/check_variant.py --rules-only                  # static rules (seconds)
    python skills/add-moe-variant/scripts/check_variant.py --family qwen3_moe \\
        --set model.topk_mass=0.5                                                       # a variant, switched on

Stages, in order (--fail-fast stops at the first that fails; --rules-only runs the first,
--no-validate the first two):
  rules   static:
          single-device  nothing in pithtrain/models/ (subfolders included) imports torch.distributed or
                         asks for ranks or meshes
          no-registry    no registration decorators, globals()/eval/exec/import_module lookups; FAMILIES in
                         models/__init__.py stays one literal dict
          config-field   every --set key is a field of that family's config, and some test under tests/ sets
                         or names it as a config key: model.<field> (an override, a ConfigError message) or
                         <field>= (a keyword argument)
          shared-code    the change copies no code: no run of DUP_LINES code lines (blank, comment, docstring
                         and import lines aside) appears more often in pithtrain/ than it did at the base,
                         committed work included. A copied family file or a block pasted into two families
                         FAILs, with both places named; a new shared file under models/ is welcome. The
                         base (printed first): --base REV's merge base with HEAD; else the first of these
                         whose pithtrain/ differs from the tree: where HEAD left its upstream branch, HEAD's
                         merge base with main, the last commit before the one that added the --set field
                         (HEAD while it is uncommitted). A base whose pithtrain/ equals the tree (e.g. after
                         committing on main with nothing else to go by) FAILs: nothing would be compared
          budget         pithtrain/ stays under BUDGET code lines (tools/appliance.py count_lines, `invoke
                         stats`); family files keep the pointer to the shape-suffix legend
  effect  the variant must act: the family's default tiny model is built twice, without and with the
          model.* overrides; the variant's model takes every base tensor of the same name and shape, and
          the header names the ones it initialises itself (seeded; e.g. a router of another width). Both
          are compared at every condition of SEEDS x ROUTER_SCALES (each router's weights scaled: x1 is
          the near-uniform router of a fresh init, where a threshold on router probabilities never
          fires; x8 and x64 are peaked routers, like trained ones). Compared: eval logits, train-mode
          gradients (the load-balancing loss included) and the routing statistics read from every MoE
          block's router outputs: experts computed per token (slots with an FFN expert's id: not DROPPED,
          not past the FFN experts; mean, min, max), the share of slots not computed, the share computed
          at weight 0, and the worst per-layer load (max / mean over the router's ids). FAIL when nothing
          differs anywhere (a no-op), or when a router breaks the contract in pithtrain/models/common.py
          (above route_tokens): (logits_TE, probs_TE, w_TA, idx_TA), idx_TA int64 with ids in [0, router
          width) or DROPPED, w_TA the same shape and finite, a dispatcher that takes slots its experts do
          not compute (LocalDispatcher(drops=True)), and the experts' witness (rows_computed) equal to the
          computed slots of the train-mode forward.
  validate  validate.py --quick --family F --set ...: parity with transformers with the variant at its
          default, grouped == loop, and a 30-step run with the variant on whose loss falls and stays finite.
Exit status 0 on PASS, 1 on FAIL.
"""

from __future__ import annotations

import argparse
import ast
import collections
import dataclasses
import math
import re
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
VALIDATE = ROOT / "skills" / "validate-correctness" / "scripts" / "validate.py"

BUDGET = 8000  # code lines of pithtrain/ (the house budget: the whole package, never a cap per file)
DUP_LINES = 6  # a run of this many code lines in two places is a copy
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


def rule_problems(root: Path, families: dict, base: str = "main") -> list[str]:
    """The static rules over the tree at `root` (see the module docstring)."""
    out, models = [], root / "pithtrain" / "models"
    # rglob: a file in a subfolder is model code too, and must not escape the rules
    for f in sorted(models.rglob("*.py")):
        rel, text = f.relative_to(root), f.read_text()
        tree = ast.parse(text)
        if f.parent == models and f.stem in families and "legend" not in (ast.get_docstring(tree) or "").lower():
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
    init = ast.parse((models / "__init__.py").read_text())
    literal = [n for n in init.body if isinstance(n, ast.Assign) and any(
        isinstance(t, ast.Name) and t.id == "FAMILIES" for t in n.targets) and isinstance(n.value, ast.Dict)]
    if not literal:
        out.append("no-registry: pithtrain/models/__init__.py: FAMILIES must be one literal dict")
    return out + copy_problems(root, base) + budget_problems(root)


def budget_problems(root: Path) -> list[str]:
    from tools.appliance import count_lines

    n = sum(count_lines(root / "pithtrain").values())
    return [] if n < BUDGET else [f"budget: pithtrain/ has {n} code lines, the budget is under {BUDGET} "
                                  "(`invoke stats` per folder): share or simplify code rather than add it"]


def code_lines(text: str) -> list[tuple[int, str]]:
    """(line number, text without indentation or trailing comment) of each code line: blank,
    comment, docstring and import lines left out (imports repeat by nature)."""
    skip, todo = set(), [ast.parse(text)]
    while todo:  # statements only (expressions hold no docstring or import): a fraction of ast.walk
        node = todo.pop()
        for name in ("body", "orelse", "finalbody", "handlers", "cases"):
            block = getattr(node, name, None)
            if not isinstance(block, list):
                continue
            for i, st in enumerate(block):
                if isinstance(st, (ast.Import, ast.ImportFrom)) or (
                        i == 0 and name == "body" and isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant)
                        and isinstance(st.value.value, str)):
                    skip.update(range(st.lineno, st.end_lineno + 1))
                elif isinstance(st, ast.AST):
                    todo.append(st)
    return [(i, s) for i, line in enumerate(text.splitlines(), 1) if i not in skip and (s := uncommented(line))]


def uncommented(line: str) -> str:
    """The line without its comment (a # outside quotes on this line), stripped."""
    quote = None
    for k, c in enumerate(line):
        if quote is None and c == "#":
            return line[:k].strip()
        if c in "'\"" and (k == 0 or line[k - 1] != "\\"):
            quote = c if quote is None else None if c == quote else quote
    return line.strip()


def repeated_runs(lines: dict[str, list[tuple[int, str]]]) -> collections.Counter:
    """How often each run of DUP_LINES consecutive code lines occurs over `lines` (path -> code_lines)."""
    runs = collections.Counter()
    for ls in lines.values():
        texts = [s for _, s in ls]
        runs.update(tuple(texts[k:k + DUP_LINES]) for k in range(len(texts) - DUP_LINES + 1))
    return runs


def choose_base(root: Path, sets: list[str], given: str | None = None) -> tuple[str, str]:
    """(git revision, how it was chosen) the shared-code rule compares with. --base, as given (its
    merge base with HEAD). Else the first of these whose pithtrain/ differs from the tree: where
    HEAD left its upstream branch, HEAD's merge base with main, the last commit before the one that
    added a --set model.X field under pithtrain/models/ (HEAD while the field is uncommitted).
    None differs: the last, and copy_problems FAILs it as the tree itself."""
    def git(*args: str) -> str | None:
        r = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else None

    if given:
        return given, f"--base {given} (its merge base with HEAD)"
    upstream = git("rev-parse", "--abbrev-ref", "--symbolic-full-name", "@{upstream}")
    candidates = [(upstream and git("merge-base", "HEAD", upstream), f"where HEAD left its upstream {upstream}"),
                  (git("merge-base", "HEAD", "main"), "HEAD's merge base with main")]
    for f in [s.split("=", 1)[0].removeprefix("model.") for s in sets if s.startswith("model.")]:
        # the oldest commit whose diff adds or removes a line `<field>:` (a dataclass field)
        commits = (git("log", "--format=%H", f"-G^[[:space:]]*{f}[[:space:]]*:", "--", "pithtrain/models") or "").split()
        candidates.append((git("rev-parse", "--verify", "-q", f"{commits[-1]}^"),
                           f"the last commit before model.{f} was added (in {commits[-1][:10]})") if commits else
                          (git("rev-parse", "HEAD"), f"HEAD: model.{f} is in no commit yet"))
    candidates = [(rev, how) for rev, how in candidates if rev] or [("HEAD", "HEAD")]
    now = tree_sources(root)
    rev, how = next(((rev, how) for rev, how in candidates if base_sources(root, rev) != now), candidates[-1])
    return rev, f"{rev[:10]}, {how}"


def tree_sources(root: Path) -> dict[str, str]:
    return {str(f.relative_to(root)): f.read_text() for f in sorted((root / "pithtrain").rglob("*.py"))}


def base_sources(root: Path, base: str) -> dict[str, str] | None:
    """pithtrain/**/*.py where HEAD branched from git revision `base` (their merge base; `base`
    itself when there is none), or None when git cannot read it."""
    fork = subprocess.run(["git", "merge-base", "HEAD", base], cwd=root, capture_output=True, text=True)
    base = fork.stdout.strip() if fork.returncode == 0 else base
    ls = subprocess.run(["git", "ls-tree", "-r", "--name-only", base, "--", "pithtrain"], cwd=root,
                        capture_output=True, text=True)
    names = [n for n in ls.stdout.split() if n.endswith(".py")]
    if ls.returncode or not names:
        return None
    cat = subprocess.run(["git", "cat-file", "--batch"], cwd=root, capture_output=True,
                         input="".join(f"{base}:{n}\n" for n in names).encode())
    out, pos, blob = {}, 0, cat.stdout
    for n in names:  # each: "<sha> blob <size>\n<content>\n"
        eol = blob.index(b"\n", pos)
        size = int(blob[pos:eol].split()[2])
        out[n] = blob[eol + 1:eol + 1 + size].decode()
        pos = eol + 2 + size
    return out


def copy_problems(root: Path, base: str) -> list[str]:
    """Runs of code lines that occur more often now than at `base`: code the change copied."""
    then = base_sources(root, base)
    base = base[:10] if re.fullmatch(r"[0-9a-f]{40}", base) else base  # as the messages name it
    if then is None:
        return [f"shared-code: git cannot read pithtrain/ at {base!r} in {root} (pass --base REV, the "
                "commit your change starts from)"]
    now = tree_sources(root)
    if now == then:
        return [f"shared-code: the base ({base}) is this tree itself: pithtrain/ has not changed since it, so "
                "the rule would compare the tree with itself and find nothing. Pass --base REV, the commit "
                "your change starts from"]
    lines = {path: code_lines(text) for path, text in now.items()}
    changed = [path for path in set(now) | set(then) if now.get(path) != then.get(path)]
    after = repeated_runs(lines)  # before: the same, with the changed files as they were
    before = after - repeated_runs({p: lines[p] for p in changed if p in now})
    before.update(repeated_runs({p: code_lines(then[p]) for p in changed if p in then}))
    new = {run for run, n in after.items() if n > 1 and n > before[run]}
    places = collections.defaultdict(list)
    for path, ls in lines.items():
        for k in range(len(ls) - DUP_LINES + 1):
            run = tuple(s for _, s in ls[k:k + DUP_LINES])
            if run in new:
                places[run].append((path, ls[k][0]))
    where = collections.defaultdict(list)  # (copy's file, original's file) -> (copy's line, original's line)
    for run, locs in places.items():
        # the copies: the occurrences the base did not have, taken from changed files, last first
        locs.sort(key=lambda loc: (loc[0] in changed, loc))
        copies = len(locs) - max(before[run], 1)
        for copy in locs[-copies:]:
            original = next(loc for loc in locs if loc not in locs[-copies:])
            where[(copy[0], original[0])].append((copy[1], original[1]))
    out = []
    for (fa, fb), pairs in sorted(where.items()):
        pairs.sort()
        out.append(f"shared-code: {fa}:{pairs[0][0]}-{pairs[-1][0]} repeats {fb}:{min(b for _, b in pairs)}-"
                   f"{max(b for _, b in pairs)} ({len(pairs) + DUP_LINES - 1} code lines or more, new since {base}): "
                   "put it in one function both call (pithtrain/models/common.py, or a new shared file, for model code)")
    return out


def override_problems(root: Path, family: str, sets: list[str], families: dict) -> list[str]:
    out = []
    fields = {f.name for f in dataclasses.fields(families[family].config)}
    tests = "\n".join(p.read_text() for p in sorted((root / "tests").glob("*.py")))
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
# Effect: the variant against the base model, where a variant can act

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
    from pithtrain.models.common import GroupedExperts

    return [m for m in model.modules() if hasattr(m, "route") and isinstance(getattr(m, "experts", None), GroupedExperts)]


def width(m) -> int:
    """The ids a block's router scores (its balancing unit's width; may exceed the FFN experts)."""
    return m.balance.num_experts if hasattr(m, "balance") else m.experts.num_experts


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
    """What the dispatchers (LocalDispatcher, the expert-parallel one) and balancing rely on from a router."""
    from pithtrain.models.common import DROPPED, LocalDispatcher, computed_slots

    if not (isinstance(out, tuple) and len(out) == 4 and all(isinstance(t, torch.Tensor) for t in out)):
        return ["route must return four tensors (logits_TE, probs_TE, w_TA, idx_TA)"]
    _, probs_TE, w_TA, idx_TA = out
    E, ffn, bad = width(m), m.experts.num_experts, []
    if idx_TA.dtype != torch.int64 or idx_TA.dim() != 2 or idx_TA.shape[0] != T:
        return [f"idx_TA must be int64 of shape (T={T}, A), got {idx_TA.dtype} {tuple(idx_TA.shape)}"]
    ids = idx_TA[idx_TA != DROPPED]
    if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < E):
        bad.append(f"idx_TA holds {int(idx_TA.min())}..{int(idx_TA.max())}: every id must be in [0, {E}) "
                   f"(the router's width, balance.num_experts) or DROPPED ({DROPPED})")
    elif (not computed_slots(idx_TA, ffn).all() and isinstance(m.dispatcher, LocalDispatcher)
          and not m.dispatcher.drops):
        bad.append(f"the router returns slots its {ffn} FFN experts do not compute (DROPPED or an id >= {ffn}) "
                   "but the block's dispatcher is LocalDispatcher() without drops: build LocalDispatcher(drops=True)")
    if w_TA.shape != idx_TA.shape:
        bad.append(f"w_TA has shape {tuple(w_TA.shape)}, idx_TA {tuple(idx_TA.shape)}: one weight per slot")
    elif not torch.isfinite(w_TA).all():
        bad.append("w_TA is not finite")
    if probs_TE.shape != (T, E):
        bad.append(f"probs_TE must be (T, E) = ({T}, {E}), got {tuple(probs_TE.shape)}")
    return bad


def routing_stats(log) -> dict:
    """Experts computed per token (slots an FFN expert computes) mean / min / max over tokens and
    layers, the share of slots not computed, the share computed at weight 0, and the worst layer's
    load max / mean over the router's ids (every id but DROPPED, as balancing counts)."""
    from pithtrain.models.common import computed_slots

    per_token, skipped, zero, slots, worst = [], 0, 0, 0, 1.0
    for m, (_, _, w_TA, idx_TA) in log:
        done_TA = computed_slots(idx_TA, m.experts.num_experts)
        per_token.append(done_TA.sum(-1))
        skipped, slots = skipped + int((~done_TA).sum()), slots + done_TA.numel()
        zero += int((done_TA & (w_TA.detach() == 0)).sum())
        load_E = torch.bincount(idx_TA[idx_TA >= 0], minlength=width(m)).double()
        worst = max(worst, float(load_E.max() / load_E.mean().clamp(min=1e-9)))
    k = torch.cat(per_token).double() if per_token else torch.zeros(1)
    return {"mean": float(k.mean()), "min": int(k.min()), "max": int(k.max()),
            "skipped": skipped / max(slots, 1), "zero": zero / max(slots, 1), "load": worst}


def variant_model(cfg, state: dict, seed: int):
    """The model of `cfg`, seeded, taking every tensor of `state` of the same name and shape; and
    the names (with shapes) of those it keeps from its own init."""
    from pithtrain.models import build_model

    torch.manual_seed(seed)
    model = build_model(cfg)
    own = model.state_dict()
    same = {k: v for k, v in state.items() if k in own and own[k].shape == v.shape}
    model.load_state_dict(same, strict=False)
    return model, [f"{k} {tuple(v.shape)}" for k, v in own.items() if k not in same]


def run_condition(model, scale: float, ids_BS, labels_BS):
    """One model at one condition: (logits, {param: grad}, routing stats, contract problems)."""
    from pithtrain.models.common import computed_slots

    with torch.no_grad():  # peak (or flatten) every router: its Linear(s) to the router's width
        for m in moe_blocks(model):
            for lin in m.children():
                if isinstance(lin, torch.nn.Linear) and lin.out_features == width(m):
                    for p in lin.parameters():
                        p.mul_(scale)
    log = record_routes(model)
    model.eval()
    try:
        with torch.no_grad():
            logits = model(ids_BS).float()
        n_eval = len(log)  # the eval forward's router calls, one per MoE block
        model.train()
        for m in moe_blocks(model):
            m.experts.rows_computed = 0
        model(ids_BS, labels_BS=labels_BS).backward()
    except Exception as e:  # e.g. an id a dispatcher cannot take: say why, not a traceback
        bad = sorted({p for m, out in log for p in contract_problems(m, out, ids_BS.numel())})
        return None, None, None, bad or [f"the forward / backward raised {type(e).__name__}: {e}"]
    bad = sorted({p for m, out in log for p in contract_problems(m, out, ids_BS.numel())})
    if not bad:  # the witness: rows the FFN experts computed in the train-mode forward
        rows = sum(m.experts.rows_computed for m in moe_blocks(model))
        slots = sum(int(computed_slots(out[3], m.experts.num_experts).sum()) for m, out in log[n_eval:])
        if rows != slots:
            bad = [f"the FFN experts computed {rows} rows for {slots} computed slots (GroupedExperts."
                   "rows_computed): a dispatcher that computes what it should drop, or the reverse"]
    stats = routing_stats(log[:n_eval]) if not bad else None
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits, grads, stats, bad


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12)) if a.shape == b.shape else math.inf


ROUTING = ("mean", "min", "max", "skipped", "zero")  # what a router decides; `load` follows any change of input


def norm(tensors) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors))


def effect_table(rows: list) -> list[str]:
    """The effect table: a row per condition, (name, None) for a broken router contract, else
    (name, (logits, grads, new grads or None, base stats, variant stats)). The new-grads column
    shows only for a variant with tensors of its own, the routing columns only for one that routes
    differently somewhere."""
    ok = [r for _, r in rows if r]
    new = any(r[2] is not None for r in ok)
    routes = any(r[3][k] != r[4][k] for r in ok for k in ROUTING)
    out = [f"  {'condition':<18} {'logits':>9} {'grads':>9}" + (f" {'new grads':>9}" if new else "")
           + ("   experts/token mean min max   skipped   at w=0   load" if routes else "")]
    for name, r in rows:
        if r is None:
            out.append(f"  {name:<18} router contract broken")
            continue
        d_logits, d_grads, d_new, b, v = r
        line = f"  {name:<18} {d_logits:9.2e} {d_grads:9.2e}" + (f" {d_new or 0.0:9.2e}" if new else "")
        if routes:
            line += (f"   {b['mean']:.2f} {b['min']} {b['max']} -> {v['mean']:.2f} {v['min']} {v['max']}   "
                     f"{100 * b['skipped']:3.0f}% -> {100 * v['skipped']:3.0f}%   "
                     f"{100 * b['zero']:3.0f}% -> {100 * v['zero']:3.0f}%   {b['load']:.2f} -> {v['load']:.2f}")
        out.append(line)
    out.append("  (logits, grads: largest difference relative to the base, over the tensors both models have"
               + ("; new grads: the gradient norm of the variant's own tensors relative to the base's whole one"
                  if new else "")
               + ("; experts/token: slots an FFN expert computed; skipped: slots DROPPED or past the FFN experts; "
                  "at w=0: computed slots of weight 0, compute spent for nothing; load: worst layer's max / mean "
                  "load over the router's ids)" if routes else
                  "; routing columns hidden: experts per token, skipped and weight-0 slots equal the base's at "
                  "every condition)"))
    return out


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
    lines, rows, broken = [], [], []
    for seed in SEEDS:
        g = torch.Generator().manual_seed(seed)
        ids_BS = torch.randint(0, base_cfg.vocab_size, (BATCH, SEQ), generator=g)
        labels_BS = torch.randint(0, base_cfg.vocab_size, (BATCH, SEQ), generator=g)
        torch.manual_seed(seed)
        state = build_model(base_cfg).state_dict()
        if seed == SEEDS[0]:
            fresh = variant_model(var_cfg, state, seed)[1]
            shared = len(state) - sum(k.split(" ")[0] in state for k in fresh)
            lines += [f"effect of {what} on {family} ({base_cfg.num_layers} layers): the variant's model "
                      f"takes {shared} of the base model's {len(state)} tensors (same name and shape)"]
            if fresh:
                names = sorted({re.sub(r"\.\d+\.", ".*.", f) for f in fresh})
                lines += [f"  fresh in the variant (its own seeded init, not the base's): {', '.join(names)}"]
        for scale in ROUTER_SCALES:
            name = f"seed {seed} router x{scale:g}"
            base = variant_model(base_cfg, state, seed)[0]
            b_logits, b_grads, b_stats, b_bad = run_condition(base, scale, ids_BS, labels_BS)
            v_logits, v_grads, v_stats, v_bad = run_condition(variant_model(var_cfg, state, seed)[0], scale,
                                                              ids_BS, labels_BS)
            broken += [f"{name}: {p}" for p in v_bad]
            if b_bad or v_bad:
                rows.append((name, None))
                continue
            same = {n for n in b_grads if n in v_grads and v_grads[n].shape == b_grads[n].shape}
            d_grads = max((rel_diff(v_grads[n], b_grads[n]) for n in same), default=0.0)
            # the variant's own tensors (new, or reshaped): their gradient's norm relative to the base's whole one
            d_new = (norm([g for n, g in v_grads.items() if n not in same]) / max(norm(b_grads.values()), 1e-12)
                     if set(v_grads) - same else None)
            rows.append((name, (rel_diff(v_logits, b_logits), d_grads, d_new, b_stats, v_stats)))
    acted = [name for name, r in rows if r and (max(r[0], r[1], r[2] or 0.0) > RTOL or r[3] != r[4])]
    lines += effect_table(rows)
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
    p.add_argument("--base", help="git revision the change started from (shared-code rule: its merge base with HEAD; "
                                  "default: the upstream branch, else the commit before the --set field was added)")
    args = p.parse_args(argv)

    from pithtrain.models import FAMILIES

    if args.family not in FAMILIES:
        sys.exit(f"error: unknown family {args.family!r} (families: {', '.join(FAMILIES)})")
    base, how = choose_base(ROOT, args.set, args.base)
    problems = rule_problems(ROOT, FAMILIES, base) + override_problems(ROOT, args.family, args.set, FAMILIES)
    print(f"shared-code base: {how}")
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
