import pytest

from pithtrain.config import ConfigError, load_config
from pithtrain.models.qwen3_moe import Qwen3MoeConfig


def write(tmp_path, text, name="r.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_default_recipe_loads():
    cfg = load_config()
    assert isinstance(cfg.model, Qwen3MoeConfig)
    assert cfg.train.steps == 300 and cfg.data.source == "stdlib"


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
])
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
