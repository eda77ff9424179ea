"""validate.py --set reaches the layout, pipeline and resume tests (PITHTRAIN_TEST_SET, tests/variant.py),
its report names the tests that ran with the switch, and it writes under its --out, not the system /tmp."""

import importlib.util
import re
from pathlib import Path

import pytest
import variant

ROOT = Path(__file__).resolve().parent.parent


def load_validate():
    path = ROOT / "skills" / "validate-correctness" / "scripts" / "validate.py"
    spec = importlib.util.spec_from_file_location("validate_script", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_layout_pipeline_and_resume_config_builders_take_the_switch(tmp_path, monkeypatch):
    import test_checkpoint
    import test_distributed
    import test_overlap
    import test_pipeline
    import test_pipeline_overlap
    log = tmp_path / "took.txt"
    monkeypatch.setenv(variant.ENV, "model.top_k=1")
    monkeypatch.setenv(variant.LOG, str(log))
    for family in ("qwen3_moe", "deepseek_v2", "gpt_oss"):
        assert test_distributed.make_cfg(family, {}, 1, str(tmp_path)).model.top_k == 1
        assert test_pipeline_overlap.cfg_for(family, {}, str(tmp_path)).model.top_k == 1
        assert test_overlap.build(family).cfg.top_k == 1
    assert test_pipeline.build().cfg.top_k == 1 and test_pipeline.train_cfg({}, str(tmp_path)).model.top_k == 1
    assert test_checkpoint.cfg_for(tmp_path).model.top_k == 1
    assert "model.top_k=1" in test_checkpoint.train_cmd(tmp_path)
    assert set(log.read_text().splitlines()) == {
        "took\ttests/test_validate.py::test_the_layout_pipeline_and_resume_config_builders_take_the_switch"}
    monkeypatch.setenv(variant.ENV, "model.n_shared_experts=2")  # DeepSeek-V2's only: the others keep theirs
    assert test_distributed.make_cfg("deepseek_v2", {}, 1, str(tmp_path)).model.n_shared_experts == 2
    assert test_distributed.make_cfg("qwen3_moe", {}, 1, str(tmp_path)).model.top_k == 2
    monkeypatch.delenv(variant.ENV)
    assert test_distributed.make_cfg("qwen3_moe", {}, 1, str(tmp_path)).model.top_k == 2


def test_a_config_that_refuses_the_switch_runs_with_it_off_and_says_why(tmp_path, monkeypatch):
    """A variant that needs an even num_kv_heads (here: top_k=1 made to need one) meets the Qwen3
    config of test_pipeline_overlap.py, which has one: that config runs without the switch and the
    log says why (the family's own check); the configs with two take it."""
    import test_checkpoint
    import test_distributed
    import test_pipeline_overlap

    from pithtrain.models.qwen3_moe import Qwen3MoeConfig
    validate = Qwen3MoeConfig.validate

    def needs_even_kv_heads(self, err):
        validate(self, err)
        if self.top_k == 1 and self.num_kv_heads % 2:
            err("num_kv_heads", f"must be even for top_k=1, got {self.num_kv_heads}")

    monkeypatch.setattr(Qwen3MoeConfig, "validate", needs_even_kv_heads)
    log = tmp_path / "took.txt"
    monkeypatch.setenv(variant.ENV, "model.top_k=1")
    monkeypatch.setenv(variant.LOG, str(log))
    assert test_pipeline_overlap.TINY["qwen3_moe"]["num_kv_heads"] == 1
    assert test_pipeline_overlap.cfg_for("qwen3_moe", {}, str(tmp_path)).model.top_k == 2  # off
    assert test_distributed.make_cfg("qwen3_moe", {}, 1, str(tmp_path)).model.top_k == 1
    assert test_checkpoint.cfg_for(tmp_path).model.top_k == 1  # the load_config path: the same rule
    assert test_checkpoint.cfg_for(tmp_path, "model.num_kv_heads=1").model.top_k == 2
    this = "tests/test_validate.py::test_a_config_that_refuses_the_switch_runs_with_it_off_and_says_why"
    off = f"off\t{this}\tmodel.num_kv_heads: must be even for top_k=1, got 1"
    assert log.read_text().splitlines() == [off, f"took\t{this}", f"took\t{this}", off]


def test_validate_names_the_tests_that_took_the_switch_and_those_that_refused_it(tmp_path):
    """Per check: the tests that ran with the switch, those whose config refused it (with the
    config's reason), and a FAIL that says so when no test took it. Everything under --out."""
    validate = load_validate()
    out = tmp_path / "out"
    probe = tmp_path / "probe" / "test_probe.py"
    probe.parent.mkdir()
    head = f"""import sys, tempfile
sys.path.insert(0, {str(ROOT / 'tests')!r})
import variant
"""
    probe.write_text(head + f"""
def test_takes_it(tmp_path):
    assert str(tmp_path).startswith({str(out)!r}) and tempfile.gettempdir().startswith({str(out)!r})
    assert variant.model({{"family": "qwen3_moe", "num_experts": 4}})["top_k"] == 3

def test_refuses_it():
    assert "top_k" not in variant.model({{"family": "qwen3_moe", "num_experts": 2}})

def test_plain():
    assert variant.overrides(["train.steps=3"]) == ["model.top_k=3"]
""")
    verdict, detail = validate.pytest([probe], out, sets=["model.top_k=3"])
    assert verdict == "PASS", detail
    assert "with model.top_k=3: 2 tests took it, 1 ran with it off" in detail, detail
    assert re.search(r"took: \S*test_probe.py::test_plain\n +took: \S*test_probe.py::test_takes_it\n"
                     r" +off \(their config refuses it: model.top_k: 3 exceeds num_experts \(2\)\):\n"
                     r" +\S*test_probe.py::test_refuses_it$", detail), detail
    assert (out / "pytest").is_dir() and (out / "tmp").is_dir()
    probe.write_text(head + "def test_other_family():\n"
                            "    assert 'n_shared_experts' not in variant.model({'family': 'qwen3_moe'})\n")
    verdict, detail = validate.pytest([probe], out, sets=["model.n_shared_experts=2"])  # no qwen3_moe field
    assert verdict == "FAIL" and "0 tests took it, 1 ran with it off" in detail, detail
    assert "off (their config refuses it: Qwen3MoeConfig has no field model.n_shared_experts)" in detail
    assert "FAIL: model.n_shared_experts=2 reached none of these tests: every config refused it" in detail
    skill = " ".join((ROOT / "skills" / "validate-correctness" / "SKILL.md").read_text().split())
    assert "(`took:`)" in skill and "(`off (their config refuses it: ...)`)" in skill  # the skill quotes the report


def test_a_failing_check_prints_every_failing_tests_name_and_assertion(tmp_path, capsys):
    """The tail of the log showed only the last failure: the first one, far above, is named too,
    with assert_close's numbers."""
    validate = load_validate()
    probe = tmp_path / "probe" / "test_two.py"
    probe.parent.mkdir()
    probe.write_text("""import torch

def test_first():
    torch.testing.assert_close(torch.zeros(4), torch.tensor([0.0, 0.0, 0.25, 0.0]), msg=lambda m: f"w1: {m}")

def test_second():
    print("\\n".join(f"noise {i}" for i in range(80)))
    assert 1 + 1 == 3, "the second"
""")
    verdict, _ = validate.pytest([probe], tmp_path / "out", k="first or second", subset=True)
    err = capsys.readouterr().err
    assert verdict == "FAIL"
    assert "FAILED test_two::test_first (failure)" in err and "FAILED test_two::test_second (failure)" in err, err
    assert "E       AssertionError: w1: Tensor-likes are not close!" in err
    assert "Greatest absolute difference: 0.25 at index (2,)" in err and "AssertionError: the second" in err
    assert "noise" not in err
    verdict, detail = validate.pytest([probe], tmp_path / "out", k="third", subset=True)
    assert (verdict, detail) == ("SKIP", "test_two.py: no test matches -k third")


@pytest.mark.parametrize("argv", [["--set", "train.lr=1e-3"], ["--quick"]])
def test_validate_says_where_it_writes(argv, monkeypatch, capsys, tmp_path):
    """The plan is printed before any check runs: stop it there."""
    validate = load_validate()

    def stop(*args, **kw):
        raise SystemExit(0)

    monkeypatch.setattr(validate, "pytest", stop)
    with pytest.raises(SystemExit):
        validate.main([*argv, "--out", str(tmp_path / "v")])
    said = capsys.readouterr().out
    assert f"writing under {tmp_path / 'v'}" in said
    if "--set" in argv:
        assert "--set train.lr=1e-3: in training qwen3_moe; not in parity" in said


# ---------------------------------------------------------------------------------------------
# Failures that explain themselves


def test_parity_helpers_keep_assert_closes_numbers():
    """assert_close(msg="name") replaces the mismatch report (max abs / rel error, shape, where)
    with the name alone: a pipeline failure said only 'bf16_1f1b: embed_tokens.weight'. A helper
    that names the tensor passes a callable that prefixes the report instead."""
    import ast
    import re

    import torch
    strings = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            name = getattr(node.func, "attr", getattr(node.func, "id", "")) if isinstance(node, ast.Call) else ""
            if name == "assert_close":
                strings += [f"{path.name}:{node.lineno}" for k in node.keywords
                            if k.arg == "msg" and not isinstance(k.value, ast.Lambda)]
    assert strings == [], f"assert_close(msg=<not a callable>) hides the numbers at {strings}"
    with pytest.raises(AssertionError) as e:
        torch.testing.assert_close(torch.zeros(3), torch.tensor([0.0, 0.5, 0.0]), msg=lambda m: f"bf16_1f1b: w: {m}")
    assert str(e.value).startswith("bf16_1f1b: w: Tensor-likes are not close!")
    assert re.search(r"Greatest absolute difference: 0\.5 at index \(1,\)", str(e.value))
