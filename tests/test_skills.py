"""Skills: every SKILL.md lints against images/versions.yaml, its CPU-capable PASS/FAIL script passes
on the tiny model, validate-correctness FAILs on a planted bug, and AGENTS.md names only real paths."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tools import skills

ROOT = Path(__file__).resolve().parent.parent
SKILLS = ["validate-correctness", "capture-profile", "add-moe-variant", "launch-multinode",
          "resume-after-failure", "benchmark-throughput"]


def script(name: str, *args, cwd=ROOT, root=ROOT, timeout=300) -> subprocess.CompletedProcess:
    """Run skills/<skill>/scripts/<file> (name = 'skill/file.py') of the tree at `root`."""
    skill, file = name.split("/")
    r = subprocess.run([sys.executable, str(root / "skills" / skill / "scripts" / file), *args],
                       cwd=cwd, capture_output=True, text=True, timeout=timeout)
    return r


def verdict(r: subprocess.CompletedProcess) -> str:
    """The last line must be PASS or FAIL and agree with the exit status."""
    last = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    assert last in ("PASS", "FAIL"), r.stdout[-2000:] + r.stderr[-2000:]
    assert (last == "PASS") == (r.returncode == 0), (last, r.returncode)
    return last


# ---------------------------------------------------------------------------------------------
# Lint


def test_every_skill_lints_clean():
    assert sorted(p.name for p in (ROOT / "skills").iterdir() if p.is_dir()) == sorted(SKILLS)
    assert skills.lint_all() == []


def test_lint_cli_is_deterministic():
    a = subprocess.run([sys.executable, "-m", "tools.skills", "lint"], cwd=ROOT, capture_output=True, text=True)
    b = subprocess.run([sys.executable, "-m", "tools.skills", "lint"], cwd=ROOT, capture_output=True, text=True)
    assert a.returncode == b.returncode == 0 and a.stdout == b.stdout and verdict(a) == "PASS"


def test_renaming_a_pin_without_updating_the_skills_fails(tmp_path):
    text = (ROOT / "images" / "versions.yaml").read_text()
    renamed, n = re.subn(r"(?m)^(\s+)torch:", r"\1pytorch:", text)
    assert n >= 1
    versions = tmp_path / "versions.yaml"
    versions.write_text(renamed)
    problems = skills.lint_all(versions_path=versions)
    assert problems and all("'torch'" in p for p in problems)
    hit = {Path(p.split(":")[0]).parent.name for p in problems}
    assert "validate-correctness" in hit
    r = subprocess.run([sys.executable, "-m", "tools.skills", "lint", "--versions", str(versions)],
                       cwd=ROOT, capture_output=True, text=True)
    assert verdict(r) == "FAIL" and "targets.hopper.torch is not in images/versions.yaml" in r.stdout


def make_skill(tmp_path, body_extra="", **front):
    d = tmp_path / "skills" / front.get("name", "demo")
    (d / "scripts").mkdir(parents=True)
    (d / "scripts" / "check.py").write_text("print('PASS')\n")
    meta = {"name": "demo", "description": "Use when testing the linter.",
            "prerequisites": {"versions": ["torch"], "commands": ["git"]}, **front}
    import yaml
    body = "# demo\n\n1. `invoke doctor --skill demo`\n2. `python scripts/check.py`\n" + body_extra
    (d / "SKILL.md").write_text(f"---\n{yaml.safe_dump(meta)}---\n{body}")
    return d


@pytest.mark.parametrize("change, message", [
    ({}, None),
    ({"description": ""}, "description"),
    ({"prerequisites": {"versions": ["no_such_pin"]}}, "no_such_pin"),
    ({"body_extra": "Read `pithtrain/nowhere.py`.\n"}, "pithtrain/nowhere.py"),
    ({"body_extra": "x\n" * 500}, "keep it under 500"),
    ({"body_extra": "Needs torch 2.11.0 exactly.\n"}, "version literal"),
    ({"body_extra": "Built from commit 0123456789abcdef0123456789abcdef01234567.\n"}, "version literal"),
    ({"body_extra": "Keep STYLE.md rules 1 and 15.\n"}, "cites STYLE.md, which is not in the repository"),
    ({"body_extra": "The protocol is shared/BENCH.md.\n"}, "cites shared/BENCH.md"),
    ({"body_extra": "Keep `AGENTS.md`, rules 1 to 4 and AGENTS.md rule 99.\n"}, "cites AGENTS.md rule 99"),
    ({"body_extra": "Layouts: `tests/test_parallel*.py`.\n"}, "names test_parallel*.py, which matches no file in tests/"),
])
def test_lint_reports_each_problem(tmp_path, change, message):
    change = dict(change)
    d = make_skill(tmp_path, change.pop("body_extra", ""), **change)
    problems = skills.lint(d, skills.load_versions())
    if message is None:
        assert problems == []
    else:
        assert any(message in p for p in problems), problems


def test_lint_requires_name_equal_to_folder_and_the_doctor_step(tmp_path):
    d = make_skill(tmp_path)
    d.rename(d.parent / "other")
    problems = skills.lint(d.parent / "other", skills.load_versions())
    assert any("must equal the folder name" in p for p in problems)
    assert any("invoke doctor --skill other" in p for p in problems)


def test_doctor_skill_checks_prerequisites(tmp_path):
    r = subprocess.run(["invoke", "doctor", "--skill", "validate-correctness"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "pin targets.hopper.torch" in r.stdout and "prerequisites PASS" in r.stdout
    r = subprocess.run(["invoke", "doctor", "--skill", "no-such-skill"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 1 and "no such skill" in r.stdout
    d = make_skill(tmp_path, prerequisites={"commands": ["pithtrain-no-such-command"], "modules": ["no_such_mod"]})
    rows = skills.check("demo", skills_dir=d.parent)
    assert [(item, ok) for item, ok, _ in rows] == [("command pithtrain-no-such-command", False),
                                                     ("module no_such_mod", False)]


def test_doctor_reports_broken_front_matter_like_lint(tmp_path, capsys):
    d = make_skill(tmp_path)
    md = d / "SKILL.md"
    md.write_text(md.read_text().replace("name: demo", "name: [demo", 1))  # an unclosed YAML list
    (msg,) = skills.lint(d, skills.load_versions())
    assert "front matter is not valid YAML" in msg
    assert skills.check("demo", skills_dir=d.parent) == [("skill demo", False, msg)]
    assert skills.main(["check", "demo", "--skills-dir", str(d.parent)]) == 1  # a MISS row, no traceback
    out = capsys.readouterr().out
    assert "MISS skill demo" in out and msg in out and "prerequisites FAIL" in out


# ---------------------------------------------------------------------------------------------
# validate-correctness: PASS on this tree, FAIL on a planted bug


def copy_repo(dst: Path) -> Path:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    for d in ("pithtrain", "tools", "tests", "skills", "images"):
        shutil.copytree(ROOT / d, dst / d, ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", dst / "pyproject.toml")
    return dst


def test_validate_correctness_passes_on_this_tree():
    r = script("validate-correctness/validate.py", "--quick")
    assert verdict(r) == "PASS", r.stdout[-3000:] + r.stderr[-3000:]
    assert re.search(r"parity qwen3_moe\s+PASS", r.stdout) and re.search(r"training qwen3_moe\s+PASS", r.stdout)


def test_validate_correctness_fails_on_a_planted_bug_twice(tmp_path):
    """A sign flip in RMSNorm (a copy of the repo; this tree is untouched): parity catches it."""
    repo = copy_repo(tmp_path / "repo")
    common = repo / "pithtrain" / "models" / "common.py"
    src = common.read_text()
    # the last `return` of RMSNorm.forward becomes `return -(...)`
    m = re.search(r"class RMSNorm\b.*?def forward\(.*?\n( +)return (.+?)\n", src, re.S)
    assert m, "RMSNorm.forward not found"
    common.write_text(src[:m.start(2)] + f"-({m[2]})" + src[m.end(2):])
    outs = [script("validate-correctness/validate.py", "--quick", "--fail-fast", cwd=repo, root=repo)
            for _ in range(2)]
    for r in outs:
        assert verdict(r) == "FAIL"
        assert f"validate-correctness: {repo}" in r.stdout  # it validated the copy, not this tree
        assert re.search(r"parity qwen3_moe\s+FAIL", r.stdout), r.stdout
    assert [ln.split()[:3] for ln in outs[0].stdout.splitlines() if ln.startswith("  ")] == \
           [ln.split()[:3] for ln in outs[1].stdout.splitlines() if ln.startswith("  ")]


# ---------------------------------------------------------------------------------------------
# The other CPU-capable scripts on the tiny model


def test_capture_profile_on_cpu(tmp_path):
    r = script("capture-profile/capture.py", "--out", str(tmp_path / "prof"))
    assert verdict(r) == "PASS", r.stdout[-3000:] + r.stderr[-3000:]
    trace = tmp_path / "prof" / "trace_rank0.json"
    assert json.loads(trace.read_text())["traceEvents"]
    for line in ("busy time", "communication", "exposed communication", "torch.profiler: top ops"):
        assert line in r.stdout
    assert re.search(r"exposed communication\s+0\.000 ms", r.stdout)  # one process: nothing to expose


def test_capture_profile_interval_arithmetic():
    sys.path.insert(0, str(ROOT / "skills" / "capture-profile" / "scripts"))
    try:
        import capture
    finally:
        sys.path.pop(0)
    ev = [("aten::mm", ("p", 1), 0.0, 10.0),             # compute on lane 1
          ("nccl:all_to_all", ("p", 2), 5.0, 15.0),      # comm on lane 2: 5..10 hidden, 10..15 exposed
          ("ncclDevKernel_AllReduce", ("p", 2), 20.0, 24.0),  # fully exposed
          ("aten::add", ("p", 2), 30.0, 31.0)]           # same lane as comm: hides nothing
    s = capture.summarize(ev)
    assert (s["busy_us"], s["comm_us"], s["exposed_us"]) == (20.0, 14.0, 9.0)


def test_launch_multinode_preflight_two_local_processes():
    r = script("launch-multinode/preflight.py", "--nproc", "2", "--timeout", "120")
    assert verdict(r) == "PASS", r.stdout[-3000:] + r.stderr[-3000:]
    assert "backend gloo, world 2" in r.stdout


def test_launch_multinode_preflight_names_missing_variables(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    for k in ("MASTER_PORT", "NNODES", "NODE_RANK", "RANK"):
        monkeypatch.delenv(k, raising=False)
    r = script("launch-multinode/preflight.py")
    assert verdict(r) == "FAIL" and "MASTER_PORT" in r.stdout and "NODE_RANK" in r.stdout


def test_resume_after_failure_drill_and_inspect(tmp_path):
    r = script("resume-after-failure/resume_check.py")
    assert verdict(r) == "PASS", r.stdout[-3000:] + r.stderr[-3000:]
    assert "resumed from" in r.stdout and "0 differ" in r.stdout
    r = script("resume-after-failure/resume_check.py", "--run-dir", str(tmp_path / "nothing"))
    assert verdict(r) == "FAIL"


def test_benchmark_throughput_and_baseline_regression(tmp_path):
    rec = tmp_path / "base.json"
    r = script("benchmark-throughput/throughput.py", "--steps", "4", "--warmup", "1", "--save", str(rec))
    assert verdict(r) == "PASS", r.stdout[-3000:] + r.stderr[-3000:]
    base = json.loads(rec.read_text())
    assert base["tokens_per_s"] > 0 and base["finite"] and base["commit"]
    base["tokens_per_s"] *= 1000  # a baseline 1000x faster: this run is a regression
    rec.write_text(json.dumps(base))
    r = script("benchmark-throughput/throughput.py", "--steps", "4", "--warmup", "1", "--baseline", str(rec))
    assert verdict(r) == "FAIL" and "slower than the baseline" in r.stdout


def test_add_moe_variant_rules(tmp_path):
    ok = script("add-moe-variant/check_variant.py", "--rules-only", "--set", "model.top_k=1")
    assert verdict(ok) == "PASS", ok.stdout
    bad = script("add-moe-variant/check_variant.py", "--rules-only", "--set", "model.no_such_field=1")
    assert verdict(bad) == "FAIL" and "no_such_field" in bad.stdout
    # a copied model file is not a variant: it breaks the config-field rule
    repo = copy_repo(tmp_path / "repo")
    models = repo / "pithtrain" / "models"
    shutil.copy(models / "qwen3_moe.py", models / "qwen3_moe_dynamic.py")
    (models / "common.py").write_text((models / "common.py").read_text()
                                      + "\n\nimport torch.distributed as dist  # noqa\n")
    r = script("add-moe-variant/check_variant.py", "--rules-only", cwd=repo, root=repo)
    assert verdict(r) == "FAIL"
    assert "qwen3_moe_dynamic.py is not a family" in r.stdout and "imports torch.distributed" in r.stdout


def test_add_moe_variant_rules_see_from_imports_and_subfolders(tmp_path):
    repo = copy_repo(tmp_path / "repo")
    models = repo / "pithtrain" / "models"
    family = models / "qwen3_moe.py"
    src = family.read_text()
    family.write_text(src + "\nfrom torch import distributed as dist  # noqa\n")
    line = len(src.splitlines()) + 2
    (models / "variants").mkdir()
    (models / "variants" / "x.py").write_text("import torch.distributed  # noqa\n\n\n@register  # noqa\n"
                                              "def route():\n    pass\n")
    r = script("add-moe-variant/check_variant.py", "--rules-only", cwd=repo, root=repo)
    assert verdict(r) == "FAIL"
    for needle in (f"qwen3_moe.py:{line} imports torch.distributed",  # from torch import distributed
                   "variants/x.py:1 imports torch.distributed",        # a subfolder is scanned too
                   "variants/x.py:4 decorator @register",
                   "variants/x.py is not a family"):
        assert needle in r.stdout, (needle, r.stdout)


# A field no test sets, for the test below. It must not be a name the skills suggest: an agent who
# follows the worked example adds that field and a test setting it, which would make the copy pass.
UNSET_FIELD = "_".join(("judge", "probe", "unset"))  # joined at run time: this file never sets it


def test_no_skill_suggests_the_unset_field_name():
    text = "\n".join(p.read_text() for p in (ROOT / "skills").rglob("*") if p.is_file() and p.suffix in (".md", ".py"))
    assert UNSET_FIELD not in text
    field_block = fenced_blocks(VARIANT_SKILL)[0]  # the worked example's config field
    assert re.match(r"\s*(\w+):", field_block)[1] != UNSET_FIELD


def test_add_moe_variant_field_must_be_set_by_a_test(tmp_path):
    """The bare word is not a test of the field; the two forms SKILL.md asks for are."""
    field = UNSET_FIELD
    repo = copy_repo(tmp_path / "repo")
    family = repo / "pithtrain" / "models" / "qwen3_moe.py"
    src = family.read_text()
    anchor = "    init_std: float = 0.02\n"
    assert anchor in src
    family.write_text(src.replace(anchor, anchor + f'    {field}: str = "topk"\n'))
    (repo / "tests" / "test_mention.py").write_text(f"# {field} is mentioned, not set\nx = '{field}'\n")
    args = ("--rules-only", "--set", f"model.{field}=dynamic")
    r = script("add-moe-variant/check_variant.py", *args, cwd=repo, root=repo)
    assert verdict(r) == "FAIL" and f"no test under tests/ sets model.{field}" in r.stdout, r.stdout
    for test in (f'def test_variant_on():\n    Qwen3MoeConfig({field}="dynamic")\n',  # the tiny config
                 f'def test_bad_value():\n    with pytest.raises(ConfigError, match="model.{field}: "):\n'
                 f'        load_config(None, ["model.{field}=nope"])\n'):     # the ConfigError test
        (repo / "tests" / "test_variant.py").write_text(test)
        r = script("add-moe-variant/check_variant.py", *args, cwd=repo, root=repo)
        assert verdict(r) == "PASS", (test, r.stdout)


# ---------------------------------------------------------------------------------------------
# add-moe-variant: the worked example, applied as written to a copy, and the judge's effect stage

VARIANT_SKILL = ROOT / "skills" / "add-moe-variant" / "SKILL.md"


def fenced_blocks(md: Path, lang: str = "python") -> list[str]:
    return [code for tag, code in re.findall(r"^```(\w*)\n(.*?)^```$", md.read_text(), re.S | re.M) if tag == lang]


def insert_after(src: str, anchor: str, text: str) -> str:
    assert src.count(anchor) == 1, anchor
    return src.replace(anchor, anchor + text)


def apply_worked_example(repo: Path, route_edit=lambda route: route) -> None:
    """The seven edits of the skill's worked example, in its order, from its code blocks;
    `route_edit` rewrites the route block (a no-op or a broken variant)."""
    field, check, init, helper, route, recipe, test, _counts = fenced_blocks(VARIANT_SKILL)
    family = repo / "pithtrain" / "models" / "qwen3_moe.py"
    src = family.read_text()
    src = insert_after(src, "    init_std: float = 0.02\n", field)
    src = insert_after(src, '            err("head_dim", f"must be even for RoPE, got {self.head_dim}")\n', check)
    src = insert_after(src, "        self.balance = Balance(cfg, cfg.num_experts, cfg.top_k)  # loss, selection bias, load (balance.py)\n", init)
    assert src.count("\nclass MoE(nn.Module):") == 1
    src = src.replace("\nclass MoE(nn.Module):", "\n" + helper + "\n\nclass MoE(nn.Module):")
    src, n = re.subn(r"    def route\(self, x_TD\):\n.*?(?=\n    def forward)", lambda m: route_edit(route), src,
                     flags=re.S)
    assert n == 1
    family.write_text(src)
    config = repo / "pithtrain" / "config.py"
    text, n = re.subn(r"^RECIPE_MODEL_FIELDS = \(.*\)$", lambda m: recipe.strip(), config.read_text(), flags=re.M)
    assert n == 1
    config.write_text(text)
    (repo / "tests" / "test_topk_mass.py").write_text(test)


def test_add_moe_variant_worked_example_as_written_passes_the_judge(tmp_path):
    """An agent's path: the skill's edits applied literally to a copy; its tests pass there (the
    loop reference in shuffled slot order, the field classified), and the judge's rules and effect
    stage PASS, showing fewer experts per token at the peaked routers."""
    repo = copy_repo(tmp_path / "repo")
    apply_worked_example(repo)
    env = {**os.environ, "PYTHONPATH": str(repo)}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_topk_mass.py",
                        "tests/test_config.py", "-k", "topk_mass or owned"], cwd=repo, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "4 passed" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]
    r = script("add-moe-variant/check_variant.py", "--family", "qwen3_moe", "--set", "model.topk_mass=0.5",
               "--no-validate", cwd=repo, root=repo)
    assert verdict(r) == "PASS", r.stdout[-4000:] + r.stderr[-3000:]
    assert re.search(r"effect: PASS \(acts at [1-6] of 6 conditions\)", r.stdout)
    peaked = [ln for ln in r.stdout.splitlines() if "router x64" in ln]
    assert peaked and all(re.search(r"2\.00 2 2 -> 1\.\d\d 1 2", ln) for ln in peaked), r.stdout


def test_add_moe_variant_judge_fails_a_no_op_and_a_router_returning_minus_one(tmp_path):
    """The field exists, is tested and validated, but route ignores it: FAIL, named a no-op, before
    any training (--fail-fast). A router that marks dropped slots with id -1: FAIL, naming the contract."""
    noop = copy_repo(tmp_path / "noop")
    apply_worked_example(noop, route_edit=lambda route: re.sub(r"        if self.topk_mass < 1:.*?\n.*?\n", "",
                                                                 route, flags=re.S))
    assert "self.topk_mass" in (noop / "pithtrain" / "models" / "qwen3_moe.py").read_text()
    r = script("add-moe-variant/check_variant.py", "--family", "qwen3_moe", "--set", "model.topk_mass=0.5",
               "--fail-fast", cwd=noop, root=noop)
    assert verdict(r) == "FAIL", r.stdout[-3000:] + r.stderr[-3000:]
    assert "architecture rules: 0 problem(s)" in r.stdout and "validate.py" not in r.stdout
    assert "effect: FAIL: model.topk_mass=0.5 is a no-op" in r.stdout, r.stdout
    minus = copy_repo(tmp_path / "minus")
    drop_by_id = ("idx_TA = torch.where(keep_top_mass(probs_TE.gather(-1, idx_TA), self.topk_mass), idx_TA, -1)")
    apply_worked_example(minus, route_edit=lambda route: re.sub(r"w_TA = w_TA \* keep_top_mass\(.*\)",
                                                                drop_by_id, route))
    assert drop_by_id in (minus / "pithtrain" / "models" / "qwen3_moe.py").read_text()
    r = script("add-moe-variant/check_variant.py", "--family", "qwen3_moe", "--set", "model.topk_mass=0.5",
               "--no-validate", cwd=minus, root=minus)
    assert verdict(r) == "FAIL", r.stdout[-3000:] + r.stderr[-3000:]
    assert "idx_TA holds -1..7: every id must be in [0, 8)" in r.stdout, r.stdout


def test_a_router_id_of_minus_one_breaks_the_local_dispatcher():
    """What the skill says a router may not return: -1 is no empty-slot id for a dispatcher."""
    import torch

    from pithtrain.models.common import GroupedExperts, LocalDispatcher
    experts = GroupedExperts(4, 8, 8)
    torch.nn.init.normal_(experts.w13_EDF2)
    torch.nn.init.normal_(experts.w2_EFD)
    x_TD, w_TA = torch.randn(3, 8), torch.ones(3, 2)
    LocalDispatcher()(x_TD, torch.tensor([[0, 1], [2, 3], [1, 0]]), w_TA, experts)
    with pytest.raises(RuntimeError, match="out of bounds"):  # the per-expert count (scatter_add_)
        LocalDispatcher()(x_TD, torch.tensor([[0, -1], [2, 3], [1, 0]]), w_TA, experts)


def test_readme_and_agents_md_give_the_three_variant_commands():
    commands = ("python skills/add-moe-variant/scripts/check_variant.py --family F --set model.X=V",
                "python skills/validate-correctness/scripts/validate.py --family F --set model.X=V",
                "python -m pytest -q -x")
    for doc in ("AGENTS.md", "README.md", "skills/add-moe-variant/SKILL.md"):
        text = " ".join((ROOT / doc).read_text().split())  # README wraps lines
        assert all(c in text for c in commands), doc
    for name in ("add-moe-variant/check_variant.py", "validate-correctness/validate.py"):
        r = script(name, "--help")
        assert r.returncode == 0 and "--family" in r.stdout and "--set" in r.stdout


def test_worked_example_helpers_do_not_assume_sorted_slots():
    """The skill's helpers, executed as written: keep_top_mass against a per-token loop, with the
    slots in topk's order, reversed, shuffled, and as DeepSeek-V2's route returns them
    (sorted=False); kept_expert_counts against a loop. Assuming slot 0 is the best fails here."""
    import torch

    from pithtrain.models.deepseek_v2 import DeepseekV2Config, MoE as DeepseekMoE
    ns = {"torch": torch}
    helper, counts = fenced_blocks(VARIANT_SKILL)[3], fenced_blocks(VARIANT_SKILL)[7]
    exec(helper + counts, ns)

    def loop(p_TA, mass):
        want = torch.zeros_like(p_TA, dtype=torch.bool)
        for t in range(len(p_TA)):
            total = 0.0
            for a in sorted(range(p_TA.shape[1]), key=lambda a: -p_TA[t, a].item()):
                want[t, a], total = total < mass, total + p_TA[t, a].item()
        return want

    torch.manual_seed(0)
    probs_TE = (torch.randn(128, 8) * 2).softmax(-1)
    p_TA = probs_TE.topk(3, dim=-1).values
    moe = DeepseekMoE(DeepseekV2Config(hidden_size=32, top_k=3))
    torch.nn.init.normal_(moe.gate.weight, std=0.5)
    _, probs, _, idx_TA = moe.route(torch.randn(128, 32))
    deepseek_TA = probs.gather(-1, idx_TA)
    assert not torch.equal(deepseek_TA, deepseek_TA.sort(-1, descending=True).values)  # unsorted indeed
    for p in (p_TA, p_TA.flip(-1), p_TA[:, torch.randperm(3)], deepseek_TA):
        for mass in (0.3, 0.6, 0.9):
            assert torch.equal(ns["keep_top_mass"](p, mass), loop(p, mass))
    w_TA = torch.where(torch.rand(128, 3) < 0.3, 0.0, 1.0)
    want = torch.zeros(8, dtype=torch.int64)
    for t, a in zip(*torch.nonzero(w_TA, as_tuple=True)):
        want[idx_TA[t, a]] += 1
    assert torch.equal(ns["kept_expert_counts"](idx_TA, w_TA, 8), want)


# ---------------------------------------------------------------------------------------------
# Every example in the skills runs as written, or the skill says why not

COMMAND_RE = re.compile(r"`((?:python|invoke|torchrun) [^`]*)`(\s*\(not run by tests[^:)]*: [^)]+\))?")


def skill_commands() -> list[tuple[str, str, str | None]]:
    """(skill, command, the '(not run by tests...: why)' after it or None) for every command a skill
    shows: a backticked span starting with python, invoke or torchrun."""
    return [(md.parent.name, m[1], m[2]) for md in sorted((ROOT / "skills").glob("*/SKILL.md"))
            for m in COMMAND_RE.finditer(md.read_text())]


def test_every_skill_command_runs_as_written_or_says_why_not():
    """The CPU commands run here, from the repository root, exactly as the skill prints them, and
    must succeed (a PASS/FAIL script must say PASS). The python blocks are the add-moe-variant worked
    example's, which the tests above apply and run; no other skill has code blocks."""
    commands = skill_commands()
    assert len(commands) > 30
    for skill in SKILLS:
        assert (skill, f"invoke doctor --skill {skill}", None) in commands
    assert [p.parent.name for p in (ROOT / "skills").glob("*/SKILL.md") if "```" in p.read_text()] == \
           ["add-moe-variant"]
    assert len(fenced_blocks(VARIANT_SKILL)) == 8 and len(re.findall(r"^```", VARIANT_SKILL.read_text(), re.M)) == 16
    ran = []
    for skill, cmd, skip in commands:
        if skip:
            continue
        r = subprocess.run(cmd, shell=True, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, (skill, cmd, r.stdout[-2000:], r.stderr[-2000:])
        if "/scripts/" in cmd:
            assert verdict(r) == "PASS", (skill, cmd)
        ran.append(cmd)
    assert any("capture.py" in c for c in ran) and any("throughput.py" in c for c in ran), ran


# ---------------------------------------------------------------------------------------------
# AGENTS.md


def test_pytest_q_prints_the_counts_and_ci_ends_with_them(tmp_path):
    """AGENTS.md says `python -m pytest -q`: with -q in the repo's addopts that became -qq, which
    hides the pass / fail count. CI's log (.ci/run ends with `invoke test`) ends with that count."""
    (tmp_path / "test_one.py").write_text("def test_one():\n    assert True\n")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c",
                        str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path), str(tmp_path / "test_one.py")],
                       cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0 and re.search(r"^1 passed in ", r.stdout, re.M), r.stdout
    assert (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1] == "invoke test"
    r = subprocess.run(["invoke", "test", "-k", "test_lint_cli_is_deterministic"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert re.fullmatch(r"=+ 1 passed, .*deselected in [\d.]+s =+", r.stdout.strip().splitlines()[-1]), r.stdout


def test_agents_md_names_only_existing_paths_and_every_skill():
    text = (ROOT / "AGENTS.md").read_text()
    paths = set(re.findall(r"`([\w./-]+\.(?:py|md|yaml|toml)|[\w.-]+/(?:[\w./-]*)?)`", text))
    assert len(paths) > 20
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert missing == [], missing
    for name in SKILLS:
        assert f"skills/{name}/" in text
    assert len(text.splitlines()) < 120  # one page
