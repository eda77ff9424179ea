"""Skills: every SKILL.md lints against images/versions.yaml, its CPU-capable PASS/FAIL script passes
on the tiny model, validate-correctness FAILs on a planted bug, and AGENTS.md names only real paths."""

import ast
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from pithtrain.models.common import DROPPED
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
    """`python -m tools.skills lint` twice, and `python tools/skills.py` (lint is the default)."""
    a = subprocess.run([sys.executable, "-m", "tools.skills", "lint"], cwd=ROOT, capture_output=True, text=True)
    b = subprocess.run([sys.executable, "-m", "tools.skills", "lint"], cwd=ROOT, capture_output=True, text=True)
    c = subprocess.run([sys.executable, "tools/skills.py"], cwd=ROOT, capture_output=True, text=True)
    assert a.returncode == b.returncode == c.returncode == 0 and a.stdout == b.stdout == c.stdout
    assert verdict(a) == "PASS"


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
    ({"body_extra": "Layouts: `tests/test_parallel*.py`.\n"},
     "names test_parallel*.py, which matches no file in tests/"),
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
# The other CPU-capable scripts on the tiny model. Each runs a command of its skill as written
# (RUN_HERE), with only where it writes added; the commands test below does not run those again.

RUN_HERE = {"capture-profile": "python skills/capture-profile/scripts/capture.py",
            "benchmark-throughput": "python skills/benchmark-throughput/scripts/throughput.py"}


def as_written(skill: str, *extra: str, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *RUN_HERE[skill].split()[1:], *extra], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def skill_module(skill: str, name: str):
    """A skill's script imported in this process (its functions, not its command line)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "skills" / skill / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_capture_profile_on_cpu(tmp_path):
    r = as_written("capture-profile", "--out", str(tmp_path / "prof"))
    assert verdict(r) == "PASS", r.stdout[-3000:] + r.stderr[-3000:]
    trace = tmp_path / "prof" / "trace_rank0.json"
    assert json.loads(trace.read_text())["traceEvents"]
    for line in ("busy time", "communication", "exposed communication", "torch.profiler: top ops"):
        assert line in r.stdout
    assert re.search(r"exposed communication\s+0\.000 ms", r.stdout)  # one process: nothing to expose


def test_capture_profile_interval_arithmetic():
    capture = skill_module("capture-profile", "capture")
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


def test_resume_after_failure_drill_then_inspect_its_runs(tmp_path):
    """The drill into --out (said, and kept); then step 2 of the skill on the restarted run:
    every checkpoint valid, the restart would take the newest. An empty run dir FAILs."""
    r = script("resume-after-failure/resume_check.py", "--out", str(tmp_path))
    assert verdict(r) == "PASS", r.stdout[-3000:] + r.stderr[-3000:]
    assert f"drill runs in {tmp_path}/A and {tmp_path}/B" in r.stdout
    assert "resumed from" in r.stdout and "step_2 at step 2" in r.stdout and "0 differ" in r.stdout
    r = script("resume-after-failure/resume_check.py", "--run-dir", str(tmp_path / "B"))
    assert verdict(r) == "PASS" and re.search(r"step_6 +valid", r.stdout) and re.search(r"step_2 +valid", r.stdout)
    assert f"resumes from {tmp_path / 'B' / 'checkpoints' / 'step_6'} (step 6" in r.stdout
    r = script("resume-after-failure/resume_check.py", "--run-dir", str(tmp_path / "nothing"))
    assert verdict(r) == "FAIL"


def test_resume_skill_quotes_what_the_checkpointer_prints():
    """The messages resume-after-failure tells an agent to look for are the code's own."""
    skill = " ".join((ROOT / "skills" / "resume-after-failure" / "SKILL.md").read_text().split())
    code = (ROOT / "pithtrain" / "checkpoint" / "dcp.py").read_text()
    for msg in ("resumed from", "(resharded)", "saved with a different model", "recipe differs from the checkpoint's",
                "was saved before these model fields existed; read as their defaults",
                "checkpoints exist but none is valid", ".abandoned-step_N", ".tmp-step_N", "TRAINING_ONLY"):
        assert msg in skill and msg.replace("step_N", "step_") in code, msg


def test_benchmark_throughput_and_baseline_regression(tmp_path):
    rec = tmp_path / "base.json"
    r = as_written("benchmark-throughput", "--save", str(rec))
    assert verdict(r) == "PASS", r.stdout[-3000:] + r.stderr[-3000:]
    assert re.search(r"^run dir \S+ \(temporary: removed at the end", r.stdout, re.M)  # says where it writes
    base = json.loads(rec.read_text())
    assert base["tokens_per_s"] > 0 and base["finite"] and base["commit"]
    base["tokens_per_s"] *= 1000  # a baseline 1000x faster: this run is a regression
    rec.write_text(json.dumps(base))
    r = script("benchmark-throughput/throughput.py", "--steps", "3", "--warmup", "1", "--baseline", str(rec),
               "--out", str(tmp_path / "run"))
    assert verdict(r) == "FAIL" and "slower than the baseline" in r.stdout
    assert (tmp_path / "run" / "metrics.jsonl").is_file()  # --out keeps the run dir


# ---------------------------------------------------------------------------------------------
# add-moe-variant: the judge's rules, in this process on a copy of the package that is a git
# repository (the shared-code rule compares with its `main`)

check_variant = skill_module("add-moe-variant", "check_variant")


@pytest.mark.quick
def test_the_package_budget_is_one_number_the_package_keeps():
    """The judge's BUDGET is the number README, AGENTS.md, the skill and docs/skills.md give, and the
    package is under it (with the worked example's edits too: its judge test below)."""
    from tools.appliance import count_lines
    budget = f"under {check_variant.BUDGET:,}"
    for doc in ("README.md", "AGENTS.md", "skills/add-moe-variant/SKILL.md", "docs/skills.md"):
        assert budget in " ".join((ROOT / doc).read_text().split()), doc
    assert sum(count_lines(ROOT / "pithtrain").values()) < check_variant.BUDGET


def git(repo: Path, *args: str):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo), *args], check=True,
                   capture_output=True)


def commit_as_main(repo: Path) -> Path:
    """Make the folder a git repository whose branch main holds it as it is."""
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "base")
    return repo


def git_copy(dst: Path) -> Path:
    """pithtrain/ and tests/ copied to dst and committed there as branch main."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for d in ("pithtrain", "tests"):
        shutil.copytree(ROOT / d, dst / d, ignore=ignore)
    return commit_as_main(dst)


def rules(repo: Path, base: str = "main") -> list[str]:
    from pithtrain.models import FAMILIES
    return check_variant.rule_problems(repo, FAMILIES, base)


def test_add_moe_variant_rules_cli():
    bad = script("add-moe-variant/check_variant.py", "--rules-only", "--set", "model.no_such_field=1", "--base",
                 "no-such-revision")
    assert verdict(bad) == "FAIL" and "model.no_such_field is not a field of Qwen3MoeConfig" in bad.stdout
    assert "git cannot read pithtrain/ at 'no-such-revision'" in bad.stdout
    assert "shared-code base: --base no-such-revision (its merge base with HEAD)" in bad.stdout


def test_the_judge_says_which_base_it_used_and_fails_on_the_tree_itself(tmp_path):
    """After committing a variant on main (no upstream), merge-base with main is the tree itself:
    the base is then the commit before the one that added the --set field; with nothing to go by
    (a field main always had) the rule FAILs saying so, instead of comparing the tree with itself.
    A clone's upstream branch comes first; with the field uncommitted, HEAD is the base."""
    repo = git_copy(tmp_path / "repo")
    first = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()

    def base(root, *sets):
        rev, how = check_variant.choose_base(root, list(sets))
        return how, rules(root, rev)

    how, problems = base(repo, "model.top_k=1")
    assert how.endswith("HEAD's merge base with main"), how
    assert len(problems) == 1 and "is this tree itself: pithtrain/ has not changed since it" in problems[0]
    family = repo / "pithtrain" / "models" / "qwen3_moe.py"
    add_field(family, "probe_switch: bool = False")
    git(repo, "commit", "-qam", "variant, committed on main")
    how, problems = base(repo, "model.probe_switch=true")
    assert how.startswith(f"{first[:10]}, the last commit before model.probe_switch was added (in "), how
    assert problems == []
    add_field(family, "probe_two: int = 0")  # uncommitted: HEAD is the base
    how, problems = base(repo, "model.probe_two=1")
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert how.startswith(head[:10]) and problems == [], how
    clone = tmp_path / "clone"
    git(tmp_path, "clone", "-q", str(repo), str(clone))
    add_field(clone / "pithtrain" / "models" / "qwen3_moe.py", "probe_three: int = 0")
    git(clone, "commit", "-qam", "a variant on the clone's main")
    how, problems = base(clone, "model.probe_three=1")
    assert how.endswith("where HEAD left its upstream origin/main") and problems == [], how
    assert "printed first as `shared-code base:`" in VARIANT_SKILL.read_text()  # the skill names the line


def add_field(family: Path, line: str) -> None:
    """`line` after the last field of the family's config dataclass (the first class with fields)."""
    src = family.read_text()
    config = next(n for n in ast.parse(src).body if isinstance(n, ast.ClassDef)
                  and any(isinstance(m, ast.AnnAssign) for m in n.body))
    last = [n for n in config.body if isinstance(n, ast.AnnAssign)][-1]
    family.write_text(splice(src, last.end_lineno + 1, last.end_lineno, f"    {line}\n"))


def test_add_moe_variant_rules_keep_shared_code_shared(tmp_path, monkeypatch):
    """No cap per file and no ban on new files: a new shared file under models/ and a common.py of
    900 lines PASS. What FAILs is a copy (a family file copied, a helper pasted into two families,
    both places named) and a package over the budget; model code importing torch.distributed too."""
    repo = git_copy(tmp_path / "repo")
    models = repo / "pithtrain" / "models"
    assert ["is this tree itself" in p for p in rules(repo)] == [True]  # nothing changed yet
    (models / "sparse.py").write_text('"""A shared block two families import."""\n\n\ndef block_mask(n):\n'
                                      '    return [[j <= i for j in range(n)] for i in range(n)]\n')
    common = models / "common.py"
    base_common = common.read_text()
    common.write_text(base_common + "".join(f"\n# a long shared file, line {i}"
                                            for i in range(900 - base_common.count("\n"))))
    assert len(common.read_text().splitlines()) >= 900 and rules(repo) == []
    from tools.appliance import count_lines  # a budget the copy below crosses, whatever the package's size
    monkeypatch.setattr(check_variant, "BUDGET", sum(count_lines(repo / "pithtrain").values()) + 100)
    shutil.copy(models / "qwen3_moe.py", models / "qwen3_moe_dynamic.py")
    helper = ("\n\ndef clamp_probs(p_TA, lo: float, hi: float):\n    p_TA = p_TA.clamp(min=lo)\n"
              "    p_TA = p_TA.clamp(max=hi)\n    total_T = p_TA.sum(-1, keepdim=True)\n"
              "    p_TA = p_TA / total_T\n    return p_TA\n")
    for family in ("deepseek_v2.py", "gpt_oss.py"):
        (models / family).write_text((models / family).read_text() + helper)
    (models / "variants").mkdir()
    (models / "variants" / "x.py").write_text("import torch.distributed  # noqa\n\n\n@register  # noqa\n"
                                              "def route():\n    pass\n")
    problems = "\n".join(rules(repo))
    assert re.search(r"shared-code: pithtrain/models/qwen3_moe_dynamic\.py:\d+-\d+ repeats "
                     r"pithtrain/models/qwen3_moe\.py:\d+-\d+ \(\d{3} code lines or more", problems), problems
    assert re.search(r"shared-code: pithtrain/models/gpt_oss\.py:\d+-\d+ repeats "
                     r"pithtrain/models/deepseek_v2\.py:\d+-\d+ \(6 code lines or more, new since main\)", problems)
    assert len(re.findall("shared-code", problems)) == 2, problems  # not the copies the base already had
    for needle in ("variants/x.py:1 imports torch.distributed", "variants/x.py:4 decorator @register",
                   "budget: pithtrain/ has"):  # the copied family file took the package over the budget
        assert needle in problems, (needle, problems)
    assert "not a family" not in problems and "lines (> " not in problems
    git(repo, "checkout", "-q", "-b", "work")  # the copies committed on a branch: measured from where it left main
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "copies")
    assert "\n".join(rules(repo)).count("shared-code") == 2


def test_add_moe_variant_rules_see_from_imports(tmp_path):
    repo = git_copy(tmp_path / "repo")
    family = repo / "pithtrain" / "models" / "qwen3_moe.py"
    src = family.read_text()
    family.write_text(src + "\nfrom torch import distributed as dist  # noqa\n")
    assert f"single-device: pithtrain/models/qwen3_moe.py:{len(src.splitlines()) + 2} imports torch.distributed" \
           in "\n".join(rules(repo))


# A field no test sets, for the test below. It must not be a name the skills suggest: an agent who
# follows the worked example adds that field and a test setting it, which would make the copy pass.
UNSET_FIELD = "_".join(("judge", "probe", "unset"))  # joined at run time: this file never sets it


def test_no_skill_suggests_the_unset_field_name():
    text = "\n".join(p.read_text() for p in (ROOT / "skills").rglob("*") if p.is_file() and p.suffix in (".md", ".py"))
    assert UNSET_FIELD not in text
    assert worked_example_field() != UNSET_FIELD


def test_add_moe_variant_field_must_be_set_by_a_test(tmp_path):
    """The bare word is not a test of the field; the two forms SKILL.md asks for are."""
    import dataclasses
    import types

    from pithtrain.models.qwen3_moe import Qwen3MoeConfig
    field = UNSET_FIELD
    config = dataclasses.make_dataclass("Probe", [(field, str, "topk")], bases=(Qwen3MoeConfig,))
    families = {"qwen3_moe": types.SimpleNamespace(config=config)}
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_mention.py").write_text(f"# {field} is mentioned, not set\nx = '{field}'\n")
    sets = [f"model.{field}=dynamic"]
    (msg,) = check_variant.override_problems(tmp_path, "qwen3_moe", sets, families)
    assert f"no test under tests/ sets model.{field}" in msg
    for test in (f'def test_variant_on():\n    Qwen3MoeConfig({field}="dynamic")\n',  # the tiny config
                 f'def test_bad_value():\n    with pytest.raises(ConfigError, match="model.{field}: "):\n'
                 f'        load_config(None, ["model.{field}=nope"])\n'):     # the ConfigError test
        (tests / "test_variant.py").write_text(test)
        assert check_variant.override_problems(tmp_path, "qwen3_moe", sets, families) == [], test


# ---------------------------------------------------------------------------------------------
# add-moe-variant: the judge's effect stage, in this process (a no-op, broken router contracts,
# the weights the variant's model takes from the base)


def test_effect_fails_a_no_op_at_every_condition():
    """init_std only shapes a fresh init, and the variant's model takes the base's weights."""
    ok, lines = check_variant.effect("qwen3_moe", ["model.init_std=0.5"])
    assert not ok and "effect: FAIL: model.init_std=0.5 is a no-op" in lines[-1], lines
    assert "takes 25 of the base model's 25 tensors" in lines[0] and not any("fresh" in ln for ln in lines)


def test_effect_names_the_tensors_the_variant_initialises_itself():
    from pithtrain.models import build_model
    base, wide = check_variant.model_configs("qwen3_moe", ["model.num_experts=10"])
    torch.manual_seed(0)
    state = build_model(base).state_dict()
    model, fresh = check_variant.variant_model(wide, state, 0)
    assert sorted(f.split(" ")[0] for f in fresh) == sorted(f"layers.{i}.mlp.{n}" for i in range(2) for n in (
        "gate.weight", "experts.w13_EDF2", "experts.w2_EFD"))
    assert torch.equal(model.state_dict()["embed_tokens.weight"], state["embed_tokens.weight"])


def test_effect_table_of_a_variant_with_new_tensors_that_does_not_route(monkeypatch):
    """Attention biases (zero at init): the logits and the shared tensors' gradients equal the
    base's, the new tensors' gradients do not. The table gives them a finite relative size (it
    said inf for any variant with tensors of its own) and hides the routing columns: nothing routes
    differently."""
    monkeypatch.setattr(check_variant, "SEEDS", (0,))
    monkeypatch.setattr(check_variant, "ROUTER_SCALES", (1.0, 8.0))
    ok, lines = check_variant.effect("qwen3_moe", ["model.attention_bias=true"])
    text = "\n".join(lines)
    assert ok and "effect: PASS (acts at 2 of 2 conditions)" in text and "inf" not in text, text
    assert next(ln for ln in lines if "condition" in ln).split() == ["condition", "logits", "grads", "new", "grads"]
    rows = [ln.split()[-3:] for ln in lines if ln.startswith("  seed 0 router")]
    assert len(rows) == 2 and all(float(a) == float(b) == 0 < float(c) < 10 for a, b, c in rows), text
    assert "routing columns hidden" in text and "experts/token" not in text


@pytest.mark.parametrize("ids, drops, message", [
    (lambda idx: torch.where(torch.arange(idx.shape[1]) == 1, DROPPED, idx), False,
     "build LocalDispatcher(drops=True)"),
    (lambda idx: idx + 1, False, "idx_TA holds 1..8: every id must be in [0, 8) (the router's width"),
    (lambda idx: torch.where(torch.arange(idx.shape[1]) == 1, DROPPED, idx), True, None),
])
def test_effect_checks_the_router_contract(monkeypatch, ids, drops, message):
    """A router returning DROPPED slots to a dispatcher without drops, or an id past its width: FAIL
    at the first condition, naming the contract. With LocalDispatcher(drops=True) the same router
    passes, and the experts' witness (rows_computed) agrees: base and variant both drop (the patch
    is the class's), so the variant (norm_topk_prob) routes as the base and the table says so."""
    from pithtrain.models import qwen3_moe
    from pithtrain.models.common import LocalDispatcher
    route, init = qwen3_moe.MoE.route, qwen3_moe.MoE.__init__

    def patched_init(self, cfg):
        init(self, cfg)
        self.dispatcher = LocalDispatcher(drops=drops)

    def patched_route(self, x_TD):
        logits_TE, probs_TE, w_TA, idx_TA = route(self, x_TD)
        return logits_TE, probs_TE, w_TA, ids(idx_TA)

    monkeypatch.setattr(qwen3_moe.MoE, "route", patched_route)
    monkeypatch.setattr(qwen3_moe.MoE, "__init__", patched_init)
    monkeypatch.setattr(check_variant, "SEEDS", (0,))
    monkeypatch.setattr(check_variant, "ROUTER_SCALES", (1.0,))
    ok, lines = check_variant.effect("qwen3_moe", ["model.norm_topk_prob=false"])
    text = "\n".join(lines)
    if message is None:
        assert ok and re.search(r"seed 0 router x1 +\d\.\d\de[-+]\d\d +\d\.\d\de[-+]\d\d$", text, re.M), text
        assert "routing columns hidden: experts per token, skipped and weight-0 slots equal the base's" in text
    else:
        assert not ok and "effect: FAIL (a router output the dispatchers cannot take)" in text
        assert message in text, text


# ---------------------------------------------------------------------------------------------
# add-moe-variant: the worked example, applied to a copy by the structure each edit names (not by
# matching source lines), and the judge's effect stage on it

VARIANT_SKILL = ROOT / "skills" / "add-moe-variant" / "SKILL.md"


def fenced_blocks(md: Path, lang: str = "python") -> list[str]:
    return [code for tag, code in re.findall(r"^```(\w*)\n(.*?)^```$", md.read_text(), re.S | re.M) if tag == lang]


def worked_example_field() -> str:
    return ast.parse(textwrap.dedent(fenced_blocks(VARIANT_SKILL)[0])).body[0].target.id


def member(tree, *names):
    """The class / function `names[0]`, then its member `names[1]`, ... (ast nodes)."""
    for name in names:
        tree = next(n for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name == name)
    return tree


def splice(src: str, first: int, last: int, text: str) -> str:
    """Lines first..last (1-based, inclusive; last = first - 1 inserts before `first`) -> text."""
    lines = src.splitlines(keepends=True)
    return "".join(lines[:first - 1]) + text + "".join(lines[last:])


def apply_worked_example(repo: Path) -> None:
    """SKILL.md's edits, each where its text says: the field after the config's last field, the
    check at the end of `validate`, the module's lines at the end of `MoE.__init__`, the helper
    above `class MoE`, `MoE.route` replaced, DROPPED imported from models.common, the field
    appended to RECIPE_MODEL_FIELDS, the test file written."""
    field, check, init, helper, route, test = fenced_blocks(VARIANT_SKILL)
    family = repo / "pithtrain" / "models" / "qwen3_moe.py"
    src = family.read_text()
    config = member(ast.parse(src), "Qwen3MoeConfig")
    last = [n for n in config.body if isinstance(n, ast.AnnAssign)][-1]
    src = splice(src, last.end_lineno + 1, last.end_lineno, field)
    src = splice(src, (end := member(ast.parse(src), "Qwen3MoeConfig", "validate").body[-1].end_lineno) + 1, end, check)
    src = splice(src, (end := member(ast.parse(src), "MoE", "__init__").body[-1].end_lineno) + 1, end, init)
    src = splice(src, member(ast.parse(src), "MoE").lineno, member(ast.parse(src), "MoE").lineno - 1, helper + "\n\n")
    node = member(ast.parse(src), "MoE", "route")
    src = splice(src, node.lineno, node.end_lineno, route)
    node = next(n for n in ast.parse(src).body
                if isinstance(n, ast.ImportFrom) and n.module == "pithtrain.models.common")
    node.names.append(ast.alias("DROPPED"))
    src = splice(src, node.lineno, node.end_lineno, ast.unparse(node) + "\n")
    family.write_text(src)
    cfg_py = repo / "pithtrain" / "config.py"
    node, fields = recipe_fields(cfg_py)
    cfg_py.write_text(splice(cfg_py.read_text(), node.lineno, node.end_lineno,
                             f"RECIPE_MODEL_FIELDS = {fields + (worked_example_field(),)!r}\n"))
    (repo / "tests" / "test_topk_mass.py").write_text(test)


def recipe_fields(cfg_py: Path) -> tuple:
    node = next(n for n in ast.parse(cfg_py.read_text()).body
                if isinstance(n, ast.Assign) and n.targets[0].id == "RECIPE_MODEL_FIELDS")
    return node, ast.literal_eval(node.value)


def test_worked_example_applies_after_unrelated_edits_to_its_neighbours(tmp_path):
    """The structure the example sits next to changes as an earlier variant would change it (a
    comment on the config's last field and a field after it, a check at the end of `validate`, a
    line at the end of `MoE.__init__`, a recipe-owned field): it still applies, each edit where the
    skill says, whatever the config's fields are and in whatever order. No source line is matched."""
    repo = tmp_path / "repo"
    (repo / "pithtrain" / "models").mkdir(parents=True)
    (repo / "tests").mkdir()
    family, cfg_py = repo / "pithtrain" / "models" / "qwen3_moe.py", repo / "pithtrain" / "config.py"
    src = (ROOT / "pithtrain" / "models" / "qwen3_moe.py").read_text()
    fields = [n.target.id for n in member(ast.parse(src), "Qwen3MoeConfig").body if isinstance(n, ast.AnnAssign)]
    last = [n for n in member(ast.parse(src), "Qwen3MoeConfig").body if isinstance(n, ast.AnnAssign)][-1]
    src = splice(src, last.end_lineno, last.end_lineno,
                 src.splitlines()[last.end_lineno - 1] + "  # a comment an earlier variant left\n")
    family.write_text(src)
    add_field(family, "probe_window: int = 0")
    src = family.read_text()
    end = member(ast.parse(src), "Qwen3MoeConfig", "validate").body[-1].end_lineno
    src = splice(src, end + 1, end,
                 '        if self.probe_window < 0:\n            err("probe_window", "must be >= 0")\n')
    end = member(ast.parse(src), "MoE", "__init__").body[-1].end_lineno
    src = splice(src, end + 1, end, "        self.probe_window = cfg.probe_window\n")
    family.write_text(src)
    text = (ROOT / "pithtrain" / "config.py").read_text()
    node, recipe = recipe_fields(ROOT / "pithtrain" / "config.py")
    cfg_py.write_text(splice(text, node.lineno, node.end_lineno,
                             f"RECIPE_MODEL_FIELDS = {recipe + ('probe_window',)!r}\n"))
    apply_worked_example(repo)
    tree, field = ast.parse(family.read_text()), worked_example_field()
    config = member(tree, "Qwen3MoeConfig")
    assert [n.target.id for n in config.body if isinstance(n, ast.AnnAssign)] == fields + ["probe_window", field]
    assert [f"self.{f}" in ast.unparse(member(tree, "Qwen3MoeConfig", "validate").body[i])
            for i, f in ((-2, "probe_window"), (-1, field))] == [True, True]
    init = [ast.unparse(n) for n in member(tree, "MoE", "__init__").body]
    assert init.index("self.probe_window = cfg.probe_window") < init.index(f"self.{field} = cfg.{field}")
    assert "keep_top_mass" in ast.unparse(member(tree, "MoE", "route"))
    assert [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))].index("keep_top_mass") == \
           [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))].index("MoE") - 1
    assert recipe_fields(cfg_py)[1] == recipe + ("probe_window", field)


def test_add_moe_variant_worked_example_as_written_passes_the_judge(tmp_path):
    """An agent's path: the skill's edits applied to a copy; its tests pass there (the loop
    references in shuffled slot order, the field classified), and the judge's rules and effect
    stage PASS, showing fewer experts computed per token at the peaked routers."""
    repo = commit_as_main(copy_repo(tmp_path / "repo"))  # main: the base of the shared-code rule
    apply_worked_example(repo)
    env = {**os.environ, "PYTHONPATH": str(repo)}
    field = worked_example_field()
    want = len(re.findall(r"^def test_", fenced_blocks(VARIANT_SKILL)[-1], re.M)) + 1  # + test_config's check
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_topk_mass.py",
                        "tests/test_config.py", "-k", f"{field} or owned"], cwd=repo, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and f"{want} passed" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]
    r = script("add-moe-variant/check_variant.py", "--family", "qwen3_moe", "--set", f"model.{field}=0.5",
               "--no-validate", cwd=repo, root=repo)
    assert verdict(r) == "PASS", r.stdout[-4000:] + r.stderr[-3000:]
    assert re.search(r"effect: PASS \(acts at [1-6] of 6 conditions\)", r.stdout)
    peaked = [ln for ln in r.stdout.splitlines() if "router x64" in ln]
    assert peaked and all(re.search(r"2\.00 2 2 -> 1\.\d\d 1 2 +0% -> +\d+%", ln) for ln in peaked), r.stdout


def test_dry_run_of_the_playbook_on_a_variant_that_needs_an_even_head_count(tmp_path):
    """The add-moe-variant playbook on a throwaway variant (written here, not shipped): a Qwen3
    switch that needs an even num_kv_heads, added to a copy as step 3 says (the field, its check in
    `validate`, RECIPE_MODEL_FIELDS, since config.json has no key for it). validate.py --set (a -k
    subset: a layout test that takes it, one whose config has one kv head, a resume test) PASSes and
    names the config that ran without it and why; export-hf of a checkpoint trained with it is
    refused in one line."""
    repo = commit_as_main(copy_repo(tmp_path / "repo"))
    family = repo / "pithtrain" / "models" / "qwen3_moe.py"
    add_field(family, "pair_heads: bool = False  # a throwaway variant: its kv heads work in pairs")
    src = family.read_text()
    end = member(ast.parse(src), "Qwen3MoeConfig", "validate").body[-1].end_lineno
    family.write_text(splice(src, end + 1, end, "        if self.pair_heads and self.num_kv_heads % 2:\n"
                             '            err("num_kv_heads", '
                             'f"must be even for pair_heads, got {self.num_kv_heads}")\n'))
    cfg_py = repo / "pithtrain" / "config.py"
    node, fields = recipe_fields(cfg_py)
    cfg_py.write_text(splice(cfg_py.read_text(), node.lineno, node.end_lineno,
                             f"RECIPE_MODEL_FIELDS = {fields + ('pair_heads',)!r}\n"))
    r = script("validate-correctness/validate.py", "--family", "qwen3_moe", "--set", "model.pair_heads=true", "-k",
               "splits_into_phases or cannot_apply or async_save_snapshots", "--out", str(tmp_path / "v"),
               cwd=repo, root=repo)
    assert verdict(r) == "PASS", r.stdout[-4000:] + r.stderr[-3000:]
    assert re.search(r"distributed +PASS .*with model.pair_heads=true: 1 tests took it, 3 ran with it off", r.stdout)
    off = r.stdout[r.stdout.index("off (their config refuses it: model.num_kv_heads: must be even for pair_heads, "
                                  "got 1):"):].splitlines()[1].strip()
    assert off == "tests/test_pipeline_overlap.py::test_pp_overlap_where_it_cannot_apply_is_a_config_error"
    assert "off (their config refuses it: DeepseekV2Config has no field model.pair_heads)" in r.stdout
    assert re.search(r"resume +PASS .*1 tests took it, 0 ran with it off", r.stdout), r.stdout
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "pithtrain.train", "model.pair_heads=true", "train.steps=1",
                          "train.seq_len=32", "train.micro_batch_size=2", "data.max_bytes=20000",
                          f"log.run_dir={tmp_path / 'run'}"], cwd=repo, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    r = subprocess.run([sys.executable, "-m", "pithtrain.checkpoint.export", "--ckpt", str(tmp_path / "run"),
                        "--out", str(tmp_path / "hf")], cwd=repo, env=env, capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and not (tmp_path / "hf").exists(), r.stderr
    assert "model.pair_heads=True would be lost: Qwen3MoeForCausalLM's config.json has no key for it" in r.stderr
    step3 = VARIANT_SKILL.read_text().split("\n3. ")[1].split("\n4. ")[0]  # how the skill says to classify it
    assert all(w in step3 for w in ("`hub_fields`", "`RECIPE_MODEL_FIELDS`", "export-hf", "`TRAINING_ONLY`"))


def test_worked_example_helper_does_not_assume_sorted_slots():
    """The skill's helper, executed as written: keep_top_mass against a per-token loop, with the
    slots in topk's order, reversed, shuffled, and as DeepSeek-V2's route returns them
    (sorted=False). Assuming slot 0 is the best fails here."""
    from pithtrain.models.deepseek_v2 import DeepseekV2Config
    from pithtrain.models.deepseek_v2 import MoE as DeepseekMoE
    ns = {"torch": torch}
    exec(fenced_blocks(VARIANT_SKILL)[3], ns)

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


def test_the_flop_guidance_names_what_the_count_reads_and_counts_an_attention_variant():
    """The skill's FLOP section names each config method flops_per_token reads and gives its
    attention term; a variant computing two maps per head, declared as the section says (heads
    doubled in attention_shapes), adds exactly that term once more per layer."""
    import dataclasses
    import inspect

    from pithtrain import metrics
    from pithtrain.models.qwen3_moe import Qwen3MoeConfig
    text = VARIANT_SKILL.read_text()
    section = text[text.index("## FLOPs of a variant"):]
    section = section[:section.index("\n## ", 1)]
    read = set(re.findall(r"model_cfg\.(\w+)\(i\)", inspect.getsource(metrics.matmul_params)
                          + inspect.getsource(metrics.flops_per_token)))
    assert read == {"layer_params", "attention_shapes"} and all(f"`{m}(i)`" in section for m in read)
    assert "`3 * keys * (d_qk + d_v) * heads`" in section and "attention variant counts what runs" in section

    class TwoMaps(Qwen3MoeConfig):
        def attention_shapes(self, i):
            window, d_qk, d_v, heads = super().attention_shapes(i)
            return window, d_qk, d_v, 2 * heads

    cfg, S = Qwen3MoeConfig(), 64
    extra = metrics.flops_per_token(TwoMaps(**dataclasses.asdict(cfg)), S) - metrics.flops_per_token(cfg, S)
    assert extra == cfg.num_layers * 3 * S * (2 * cfg.head_dim) * cfg.num_heads


def test_readme_and_agents_md_give_the_three_variant_commands():
    commands = ("python skills/add-moe-variant/scripts/check_variant.py --family F --set model.X=V",
                "python skills/validate-correctness/scripts/validate.py --family F --set model.X=V",
                "invoke test")
    for doc in ("AGENTS.md", "README.md", "skills/add-moe-variant/SKILL.md"):
        text = " ".join((ROOT / doc).read_text().split())  # README wraps lines
        assert all(c in text for c in commands), doc
    for name in ("add-moe-variant/check_variant.py", "validate-correctness/validate.py"):
        r = script(name, "--help")
        assert r.returncode == 0 and "--family" in r.stdout and "--set" in r.stdout


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
    must succeed (a PASS/FAIL script must say PASS); those in RUN_HERE ran in their own tests above,
    as written plus where to write. The python blocks are the add-moe-variant worked example's,
    which the tests above apply and run; no other skill has code blocks."""
    commands = skill_commands()
    assert len(commands) > 30
    for skill in SKILLS:
        assert (skill, f"invoke doctor --skill {skill}", None) in commands
    for skill, cmd in RUN_HERE.items():
        assert (skill, cmd, None) in commands
    assert [p.parent.name for p in (ROOT / "skills").glob("*/SKILL.md") if "```" in p.read_text()] == \
           ["add-moe-variant"]
    assert len(fenced_blocks(VARIANT_SKILL)) == 6 and len(re.findall(r"^```", VARIANT_SKILL.read_text(), re.M)) == 12
    ran = []
    for skill, cmd, skip in commands:
        if skip or RUN_HERE.get(skill) == cmd:
            continue
        r = subprocess.run(cmd, shell=True, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, (skill, cmd, r.stdout[-2000:], r.stderr[-2000:])
        if "/scripts/" in cmd:
            assert verdict(r) == "PASS", (skill, cmd)
        ran.append(cmd)
    assert len(ran) >= len(SKILLS), ran


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
    r = subprocess.run(["invoke", "test", "-k", "test_lint_cli_is_deterministic"], cwd=ROOT / "docs",
                       capture_output=True, text=True)  # from a subdirectory: still the repo's tests
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
