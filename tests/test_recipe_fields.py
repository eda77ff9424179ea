"""Extension points outside the model: a checkpoint saved before a model field existed still resumes
(the field reads as its default, said in one line), and `parallel: auto` with document masking
loads (auto then keeps the layouts document masking supports)."""

from types import SimpleNamespace

import pytest
import yaml

from pithtrain.checkpoint.dcp import RECIPE, CheckpointError, Checkpointer
from pithtrain.config import load_config


def compare(cfg, saved: dict, tmp_path) -> list[str]:
    """Checkpointer._compare_recipe of a checkpoint whose recipe is `saved`: the lines it says."""
    (tmp_path / RECIPE).write_text(yaml.safe_dump(saved))
    said = []
    Checkpointer._compare_recipe(SimpleNamespace(cfg=cfg, say=said.append), tmp_path)
    return said


def test_a_model_field_added_since_the_save_reads_as_its_default(tmp_path):
    cfg = load_config(None, [])
    older = cfg.to_dict()
    del older["model"]["z_loss_coeff"], older["model"]["bias_update_rate"]  # fields the older code lacked
    said = compare(cfg, older, tmp_path)
    assert len(said) == 1 and "saved before these model fields existed" in said[0]
    assert "read as their defaults: bias_update_rate=0.001, z_loss_coeff=0.0" in said[0]
    assert compare(cfg, cfg.to_dict(), tmp_path) == []  # the same recipe: nothing to say


def test_a_model_field_that_differs_still_refuses(tmp_path):
    now = load_config(None, ["model.z_loss_coeff=0.01"])
    older = now.to_dict()
    del older["model"]["z_loss_coeff"]  # absent: its default, 0.0, is not the 0.01 asked for now
    with pytest.raises(CheckpointError, match=r"saved with a different model: model.z_loss_coeff: 0.0 in the "
                                              r"checkpoint, 0.01 now"):
        compare(now, older, tmp_path)
    saved = load_config(None, ["model.top_k=1"]).to_dict()  # present, with another value: as before
    with pytest.raises(CheckpointError, match="model.top_k: 1 in the checkpoint, 2 now"):
        compare(load_config(None, []), saved, tmp_path)


@pytest.mark.parametrize("feature", ["data.document_mask=true", "train.eval_every=5"])
def test_parallel_auto_loads_with_features_that_exclude_cp_or_pp(feature):
    """Both once crashed at load ('>' between None and int: the checks read the sizes auto had not
    filled yet). Auto now chooses only among layouts the feature supports; a size given is checked."""
    from pithtrain.config import ConfigError
    from pithtrain.plan import candidates
    cfg = load_config(None, ["parallel.auto=true", feature])
    layouts = candidates(cfg, 4)
    assert layouts and all(lay["pp"] == 1 for lay in layouts)
    if feature.startswith("data."):
        assert all(lay["cp"] == 1 for lay in layouts)
        with pytest.raises(ConfigError, match="data.document_mask: not supported with parallel.cp > 1"):
            load_config(None, ["parallel.auto=true", "parallel.cp=2", feature])
    assert max(lay["pp"] for lay in candidates(load_config(None, ["parallel.auto=true", "train.grad_accum=4"]), 4)) > 1
