import dataclasses

import pytest

from pithtrain.config import ConfigError, load_config
from pithtrain.models.qwen3_moe import Qwen3MoeConfig


def write(tmp_path, text, name="r.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


@pytest.mark.quick
def test_default_recipe_loads():
    cfg = load_config()
    assert isinstance(cfg.model, Qwen3MoeConfig)
    assert cfg.train.steps == 300 and cfg.data.source == "stdlib"


@pytest.mark.quick
def test_overrides_apply_with_types():
    cfg = load_config(None, ["train.lr=1e-3", "model.num_layers=3", "train.compile=true"])
    assert cfg.train.lr == pytest.approx(1e-3) and isinstance(cfg.train.lr, float)
    assert cfg.model.num_layers == 3 and cfg.train.compile is True


def test_yaml_exponent_without_dot_is_a_number(tmp_path):
    cfg = load_config(write(tmp_path, "train:\n  lr: 1e-3\n"))
    assert cfg.train.lr == pytest.approx(1e-3)


@pytest.mark.parametrize("text, needle", [
    # a key under the wrong section: names the file, the key and where it belongs
    ("model:\n  lr: 1e-3\n", "model.lr: unknown key; did you mean train.lr?"),
    ("train:\n  setps: 10\n", "train.setps: unknown key; did you mean 'steps'?"),
    ("parallel:\n  pp_microbatches: 4\n", "parallel.pp_microbatches: unknown key"),  # removed: always grad_accum
    ("model:\n  num_experts: -1\n", "model.num_experts: must be >= 1, got -1"),
    ("train:\n  lr: fast\n", "train.lr: expected a number, got 'fast'"),
    ("train:\n  steps: 2.5\n", "train.steps: expected an integer, got 2.5"),
    ("data:\n  source: shards\n  path: /no/such/dir\n", "data.path: '/no/such/dir' is not a token-shard directory"),
    ("data:\n  source: shards\n", "data.path: data.source is 'shards' but no data.path is given"),
    ("data:\n  source: web\n", "data.source: expected one of 'stdlib', 'shards', got 'web'"),
    ("model:\n  family: llama\n", "model.family: unknown family 'llama'"),
    ("modle:\n  num_layers: 2\n", "modle: unknown section; did you mean 'model'?"),
    ("model:\n  top_k: 9\n  num_experts: 8\n", "model.top_k: 9 exceeds num_experts (8)"),
    ("train:\n  seq_len: 100000\n", "train.seq_len: 100000 exceeds model.max_position_embeddings"),
    ("train: [1, 2]\n", "train: expected a mapping of keys"),
    ("model: [1, 2]\n", "model: expected a mapping of keys, got [1, 2]"),
    ("model:\n  family: [1]\n", "model.family: unknown family [1]"),
    ("train:\n  lr: .inf\n", "train.lr: must be a finite number > 0, got inf"),
    ("train:\n  lr: .nan\n", "train.lr: must be a finite number > 0, got nan"),
    ("train:\n  eps: 0\n", "train.eps: must be a finite number > 0, got 0.0"),
    ("train:\n  weight_decay: -0.1\n", "train.weight_decay: must be a finite number >= 0, got -0.1"),
    ("train:\n  grad_clip: .nan\n", "train.grad_clip: must be a finite number >= 0 (0 disables), got nan"),
    ("train:\n  lr: [\n", "not valid YAML"),
    ("data:\n  path: corpus\n", "data.path: 'corpus' is given but data.source is 'stdlib'"),
    ("train:\n  decay_ratio: 0.3\n", "train.decay_ratio: applies to train.lr_schedule=wsd only (it is 'cosine')"),
    ("train:\n  lr_schedule: wsd\n  decay_ratio: 1.5\n", "train.decay_ratio: must be in [0, 1], got 1.5"),
    ("train:\n  lr_schedule: step\n", "train.lr_schedule: expected one of 'cosine', 'wsd', 'linear', 'constant'"),
])
@pytest.mark.quick
def test_bad_recipes_fail_with_a_clear_line(tmp_path, text, needle):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    assert needle in msg
    assert str(path) in msg and "\n" not in msg


@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_non_finite_lr_override_is_rejected(value):
    with pytest.raises(ConfigError, match=f"train.lr: must be a finite number > 0, got {value}"):
        load_config(None, [f"train.lr={value}"])


def test_empty_section_takes_overrides(tmp_path):
    cfg = load_config(write(tmp_path, "train:\nmodel:\n"), ["train.steps=1", "model.num_layers=3"])
    assert cfg.train.steps == 1 and cfg.model.num_layers == 3


def test_override_into_a_non_section(tmp_path):
    with pytest.raises(ConfigError, match=r"override 'train.steps=1': train is not a section \(it is \[1, 2\]\)"):
        load_config(write(tmp_path, "train: [1, 2]\n"), ["train.steps=1"])


def test_bad_override_format():
    with pytest.raises(ConfigError, match="expected section.key=value"):
        load_config(None, ["lr=1"])


def test_missing_recipe_file_lists_embedded_ones():
    with pytest.raises(ConfigError, match="embedded recipes: .*default"):
        load_config("no-such-recipe.yaml")


def test_typo_fails_before_training_starts(tmp_path, capsys):
    from pithtrain.train import main

    path = write(tmp_path, "model:\n  lr: 1e-3\n")
    assert main([str(path)]) == 2
    err = capsys.readouterr()
    assert "did you mean train.lr?" in err.err
    assert "step" not in err.out  # nothing trained


# ---------------------------------------------------------------------------------------------
# train.init_from: which model fields the recipe keeps (RECIPE_MODEL_FIELDS) and which the hub owns
# (each family's hub_fields: what its to_hf writes)


def unclassified(config_cls) -> list[str]:
    from pithtrain import config
    return [f.name for f in dataclasses.fields(config_cls)
            if f.name not in config.RECIPE_MODEL_FIELDS and f.name not in config_cls.hub_fields]


def read_by_to_hf(config_cls) -> list[str]:
    """The fields a default config's to_hf reads (through helper methods too), in order."""
    names, seen = {f.name for f in dataclasses.fields(config_cls)}, []

    class Recorder(config_cls):
        def __getattribute__(self, name):
            if name in names and name not in seen:
                seen.append(name)
            return object.__getattribute__(self, name)

    Recorder().to_hf()
    return seen


@pytest.mark.quick
def test_every_family_model_field_is_recipe_or_hub_owned():
    """A field added to a family config (a variant's switch) must be classified: in the family's
    hub_fields (its to_hf writes it) or in pithtrain/config.py's RECIPE_MODEL_FIELDS (kept across
    train.init_from). hub_fields is exactly what to_hf reads: export's refusal relies on it."""
    from pithtrain.models import FAMILIES
    for name, fam in FAMILIES.items():
        assert unclassified(fam.config) == [], (
            f"{name}: classify these fields: {fam.config.__name__}.hub_fields if its to_hf writes them, else "
            "RECIPE_MODEL_FIELDS in pithtrain/config.py")
        assert sorted(fam.config.hub_fields) == sorted(read_by_to_hf(fam.config)), name
    # the check above fails for a field nobody classified
    planted = dataclasses.make_dataclass("Planted", [("no_list_names_this", float, 1.0)], bases=(Qwen3MoeConfig,))
    assert unclassified(planted) == ["no_list_names_this"] and "no_list_names_this" not in read_by_to_hf(planted)


@pytest.fixture
def hub_dir(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=264, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, max_position_embeddings=128, router_aux_loss_coef=0.5)
    transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


def test_init_from_keeps_every_recipe_model_field(hub_dir, tmp_path, monkeypatch):
    """The checkpoint owns the model, except RECIPE_MODEL_FIELDS: each keeps the recipe's value in
    the config and in the model train() builds. norm_topk_prob stands in for a training-only switch."""
    from pithtrain import config, train
    fields = ("aux_loss_coeff", "norm_topk_prob")
    monkeypatch.setattr(config, "RECIPE_MODEL_FIELDS", fields)
    overrides = [f"train.init_from={hub_dir}", "model.aux_loss_coeff=0.02", "model.norm_topk_prob=false",
                 "model.hidden_size=64", "train.steps=1", "train.seq_len=16", "train.micro_batch_size=2",
                 "data.max_bytes=20000", "checkpoint.final=false", f"log.run_dir={tmp_path / 'run'}"]
    cfg = load_config(None, overrides)
    assert cfg.model.hidden_size == 32  # hub-owned: the checkpoint's
    assert (cfg.model.aux_loss_coeff, cfg.model.norm_topk_prob) == (0.02, False)  # recipe-owned
    _, model = train.train(cfg, resume=False)
    moes = [m for m in model.modules() if hasattr(m, "norm_topk_prob")]
    assert moes and all(m.norm_topk_prob is False and m.balance.aux_loss_coeff == 0.02 for m in moes)


def test_init_from_refuses_a_recipe_field_the_checkpoints_family_lacks(hub_dir, tmp_path, monkeypatch):
    from pithtrain import config
    monkeypatch.setattr(config, "RECIPE_MODEL_FIELDS", ("aux_loss_coeff", "topk_method"))
    with pytest.raises(ConfigError, match=r"model.topk_method: Qwen3MoeConfig \(train.init_from's family\) "
                                          "has no such field"):
        load_config(write(tmp_path, "model:\n  family: deepseek_v2\n  topk_method: greedy\n"),
                    [f"train.init_from={hub_dir}"])


def test_init_from_refuses_a_recipe_value_it_would_lose_in_one_line(hub_dir, tmp_path, monkeypatch):
    """A recipe's non-default field that neither config.json (the hub family's hub_fields) nor the
    recipe (RECIPE_MODEL_FIELDS) gives the model: refused, named, instead of silently dropped."""
    from pithtrain import config
    with pytest.raises(ConfigError, match=r"model.n_shared_experts: 1 would be lost: Qwen3MoeConfig "
                                          r"\(train.init_from's family\) has no such field"):
        load_config(write(tmp_path, "model:\n  family: deepseek_v2\n  n_shared_experts: 1\n"),
                    [f"train.init_from={hub_dir}"])
    monkeypatch.setattr(config, "RECIPE_MODEL_FIELDS", ("aux_loss_coeff", "balance", "bias_update_rate"))
    with pytest.raises(ConfigError) as e:  # z_loss_coeff unclassified: a variant's field left out of the list
        load_config(None, [f"train.init_from={hub_dir}", "train.seq_len=16", "model.z_loss_coeff=0.1"])
    assert str(e.value).endswith("model.z_loss_coeff: 0.1 would be lost: train.init_from's config.json has no key "
                                 "for it; keep it in RECIPE_MODEL_FIELDS (pithtrain/config.py)"), e.value
    assert "\n" not in str(e.value)
    assert load_config(None, [f"train.init_from={hub_dir}", "train.seq_len=16"]).model.z_loss_coeff == 0.0  # default


# ---------------------------------------------------------------------------------------------
# Errors name where a value came from; `invoke config`; defaults; warnings; invoke from anywhere


@pytest.mark.parametrize("overrides, needle", [
    (["trian.lr=1"], "command-line override 'trian.lr=1': trian: unknown section"),
    (["data.source=shards"], "default.yaml with command-line override 'data.source=shards': data.path: "
                             "data.source is 'shards' but no data.path is given"),
    (["model.family=gpt_oss"], "default.yaml with command-line override 'model.family=gpt_oss': "
                               "model.moe_intermediate_size: unknown key"),
    (["train.lr=1e-3", "model.family=deepseek_v2", "model.top_k=2"],
     "default.yaml with command-line overrides 'model.family=deepseek_v2', 'model.top_k=2': model.num_kv_heads"),
])
def test_an_error_caused_by_an_override_names_it_not_only_the_recipe(overrides, needle):
    """The recipe was blamed for a key that came from, or was made wrong by, the command line."""
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_config_prints_the_resolved_recipe_and_every_key(capsys):
    import yaml

    from pithtrain.config import SECTIONS, main
    from pithtrain.models import FAMILIES
    assert main(["train.lr=1e-3", "model.vocab_size=auto"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# ") and "# model.vocab_size: auto -> 320" in out
    assert yaml.safe_load(out) == load_config(None, ["train.lr=1e-3", "model.vocab_size=auto"]).to_dict()
    assert main(["qwen3-30b-a3b", "--keys"]) == 0
    rows = capsys.readouterr().out.splitlines()
    n = sum(len(dataclasses.fields(c)) for c in (FAMILIES["qwen3_moe"].config, *SECTIONS.values()))
    assert len(rows) == n
    assert [r.split() for r in rows if r.startswith(("train.lr_schedule ", "model.vocab_size ", "train.steps "))] == [
        ["model.vocab_size", "int", "|", "'auto'", "264", "recipe:", "151936"],
        ["train.steps", "int", "200", "recipe:", "1000"],
        ["train.lr_schedule", "'cosine'", "|", "'wsd'", "|", "'linear'", "|", "'constant'", "'cosine'"]]
    assert main(["train.lr=fast"]) == 2 and "train.lr: expected a number" in capsys.readouterr().err


def test_training_only_model_defaults_agree_with_the_shipped_recipes_or_the_recipe_says_so():
    """default.yaml said aux_loss_coeff 0.01 where the classes defaulted to 0.001, and a recipe
    without the line collapsed to 2 of 8 experts: each training-only model field a shipped recipe
    sets is the class default, or its line (or the comment above it) names the class default."""
    import yaml

    from pithtrain.config import RECIPE_MODEL_FIELDS, RECIPES_DIR
    from pithtrain.models import FAMILIES
    for path in sorted(RECIPES_DIR.glob("*.yaml")):
        lines = path.read_text().splitlines()
        model = yaml.safe_load(path.read_text())["model"]
        defaults = {f.name: f.default for f in dataclasses.fields(FAMILIES[model["family"]].config)}
        for k in RECIPE_MODEL_FIELDS:
            default = defaults.get(k)
            if k in model and model[k] != default:
                i = next(n for n, line in enumerate(lines) if line.strip().startswith(f"{k}:"))
                assert f"class default is {default}" in lines[i] + lines[i - 1], (path.name, k, default)


def test_a_run_without_balancing_or_with_a_collapsed_load_gets_a_warning(tiny_overrides, capsys):
    from pithtrain.train import collapse_watch, startup_lines, train

    class Batches:
        about = "the data"

    for overrides, needle in ((["model.aux_loss_coeff=0"], "WARNING: model.aux_loss_coeff is 0: nothing balances "
                                                           "the experts' load"),
                              (["model.balance=none"], "WARNING: model.balance is none: nothing balances"),
                              (["model.balance=bias", "model.bias_update_rate=0"],
                               "WARNING: model.bias_update_rate is 0")):
        assert [line for line in startup_lines(load_config(None, overrides), Batches) if needle in line], overrides
    assert not [line for line in startup_lines(load_config(None), Batches) if "WARNING" in line]
    check = collapse_watch(load_config(None).model, n=3)  # 8 experts, top-2: max / mean is at most 4
    streak_broken = [{"load_max_mean": {"0": 4.0, "1": 1.2}}] * 2 + [{"load_max_mean": {"0": 3.0, "1": 1.1}}]
    assert [check(r) for r in streak_broken + [{"load_max_mean": {"0": 4.0, "1": 4.0}}] * 2] == [None] * 5
    assert check({"load_max_mean": {"0": 4.0, "1": 1.1}}) == (
        "pithtrain: WARNING: expert load collapsed in layer(s) 0: max/mean 4 (every token on the same 2 of 8 "
        "experts) for 3 logged steps; raise model.aux_loss_coeff or set model.balance=bias")
    assert check({"load_max_mean": {"0": 4.0, "1": 4.0}}) is None  # said once
    # a real run without balancing at a high learning rate collapses within a few steps, and says so
    run = [o for o in tiny_overrides if not o.startswith(("train.steps", "log.every", "train.warmup"))]
    train(load_config(None, run + ["train.steps=8", "log.every=1", "model.aux_loss_coeff=0", "train.lr=0.05",
                                   "train.warmup_steps=1", "checkpoint.final=false", "log.tensorboard=false"]))
    out = capsys.readouterr().out
    assert "WARNING: model.aux_loss_coeff is 0" in out and "WARNING: expert load collapsed in layer(s)" in out


def test_invoke_runs_from_a_subdirectory_of_the_checkout():
    """The Pythons a task starts import tools from there (`python -m tools.skills`), and docker lines,
    whose compose/ and images/ paths are the checkout's, run from its root."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent

    def invoke(*args):
        r = subprocess.run([sys.executable, "-m", "invoke", *args], cwd=root / "tests", capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, (args, r.stdout, r.stderr)
        return r.stdout

    assert "prerequisites PASS" in invoke("doctor", "--skill", "validate-correctness")
    lines = invoke("train", "--gpu", "h200", "--dry-run").splitlines()
    assert lines and all(line.startswith(f"cd {root} && ") and " docker " in line for line in lines)
    assert "  steps: 7\n" in invoke("config", "--set", "train.steps=7")
