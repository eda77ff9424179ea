"""Skills: every SKILL.md lints against images/versions.yaml, its CPU-capable PASS/FAIL script passes
on the tiny model, validate-correctness FAILs on a planted bug, and AGENTS.md names only real paths."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pithtrain import skills

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
    a = subprocess.run([sys.executable, "-m", "pithtrain.skills", "lint"], cwd=ROOT, capture_output=True, text=True)
    b = subprocess.run([sys.executable, "-m", "pithtrain.skills", "lint"], cwd=ROOT, capture_output=True, text=True)
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
    r = subprocess.run([sys.executable, "-m", "pithtrain.skills", "lint", "--versions", str(versions)],
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
    for d in ("pithtrain", "tests", "skills", "images"):
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


def test_add_moe_variant_field_must_be_set_by_a_test(tmp_path):
    """The bare word is not a test of the field; the two forms SKILL.md asks for are. The field name
    is built at run time so that this file never sets it, here or in the copy."""
    field = "router"
    repo = copy_repo(tmp_path / "repo")
    family = repo / "pithtrain" / "models" / "qwen3_moe.py"
    src = family.read_text()
    anchor = "    init_std: float = 0.02\n"
    assert anchor in src
    family.write_text(src.replace(anchor, anchor + f'    {field}: str = "topk"\n'))
    assert field in (repo / "tests" / "test_gpt_oss.py").read_text()  # HF's router weights, unrelated
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
# AGENTS.md


def test_agents_md_names_only_existing_paths_and_every_skill():
    text = (ROOT / "AGENTS.md").read_text()
    paths = set(re.findall(r"`([\w./-]+\.(?:py|md|yaml|toml)|[\w.-]+/(?:[\w./-]*)?)`", text))
    assert len(paths) > 20
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert missing == [], missing
    for name in SKILLS:
        assert f"skills/{name}/" in text
    assert len(text.splitlines()) < 120  # one page
