"""validate.py --set reaches the layout, pipeline and resume tests (PITHTRAIN_TEST_SET, tests/variant.py),
its report names the tests that ran with the switch, and it writes under its --out, not the system /tmp."""

import importlib.util
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
        "tests/test_validate.py::test_the_layout_pipeline_and_resume_config_builders_take_the_switch"}
    monkeypatch.setenv(variant.ENV, "model.n_shared_experts=2")  # DeepSeek-V2's only: the others keep theirs
    assert test_distributed.make_cfg("deepseek_v2", {}, 1, str(tmp_path)).model.n_shared_experts == 2
    assert test_distributed.make_cfg("qwen3_moe", {}, 1, str(tmp_path)).model.top_k == 2
    monkeypatch.delenv(variant.ENV)
    assert test_distributed.make_cfg("qwen3_moe", {}, 1, str(tmp_path)).model.top_k == 2


def test_validate_names_the_tests_that_took_the_switch_and_writes_under_out(tmp_path):
    validate = load_validate()
    out = tmp_path / "out"
    probe = tmp_path / "probe" / "test_probe.py"
    probe.parent.mkdir()
    probe.write_text(f"""import sys, tempfile
sys.path.insert(0, {str(ROOT / 'tests')!r})
import variant

def test_takes_it(tmp_path):
    assert str(tmp_path).startswith({str(out)!r}) and tempfile.gettempdir().startswith({str(out)!r})
    assert variant.model({{"family": "qwen3_moe", "top_k": 2}})["top_k"] == 1

def test_plain():
    assert variant.overrides("gpt_oss") == ["model.top_k=1"]
""")
    verdict, detail = validate.pytest([probe], out, sets=["model.top_k=1"])
    assert verdict == "PASS", detail
    assert "with model.top_k=1: 2 tests" in detail and "test_probe.py::test_takes_it" in detail, detail
    assert (out / "pytest").is_dir() and (out / "tmp").is_dir()
    probe.write_text(probe.read_text().split("def test_takes_it")[0]
                     + "def test_other_family():\n    assert 'n_shared_experts' not in variant.model({'family': 'qwen3_moe'})\n")
    verdict, detail = validate.pytest([probe], out, sets=["model.n_shared_experts=2"])  # no qwen3_moe field
    assert verdict == "FAIL" and "0 tests" in detail and "no test's family" in detail, detail


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
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "assert_close":
                strings += [f"{path.name}:{node.lineno}" for k in node.keywords
                            if k.arg == "msg" and not isinstance(k.value, ast.Lambda)]
    assert strings == [], f"assert_close(msg=<not a callable>) hides the numbers at {strings}"
    with pytest.raises(AssertionError) as e:
        torch.testing.assert_close(torch.zeros(3), torch.tensor([0.0, 0.5, 0.0]), msg=lambda m: f"bf16_1f1b: w: {m}")
    assert str(e.value).startswith("bf16_1f1b: w: Tensor-likes are not close!")
    assert re.search(r"Greatest absolute difference: 0\.5 at index \(1,\)", str(e.value))
