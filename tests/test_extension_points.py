"""Extension points a variant meets outside its model file: a checkpoint saved before a model field
existed still resumes (the field reads as its default, said in one line); `parallel: auto` with
document masking loads (auto then keeps the layouts document masking supports); context parallel
replaces only models.common.attention and refuses a variant's own, naming the module."""

import re
from types import SimpleNamespace

import pytest
import torch
import yaml
from run_path import one_gpu_kernels

from pithtrain import build
from pithtrain.build import check_run
from pithtrain.checkpoint.dcp import RECIPE, Checkpointer, CheckpointError
from pithtrain.config import ConfigError, load_config
from pithtrain.distributed.context_parallel import ContextParallelAttention
from pithtrain.distributed.parallelize import parallelize
from pithtrain.models import build_model
from pithtrain.models.common import use_kernels
from pithtrain.plan import candidates, resolve
from pithtrain.precision import Precision


def compare(cfg, saved: dict, tmp_path) -> list[str]:
    """Checkpointer._compare_recipe of a checkpoint whose recipe is `saved`: the lines it says."""
    (tmp_path / RECIPE).write_text(yaml.safe_dump(saved))
    said = []
    Checkpointer._compare_recipe(SimpleNamespace(cfg=cfg, say=said.append), tmp_path)
    return said


@pytest.mark.quick
def test_a_model_field_added_since_the_save_reads_as_its_default(tmp_path):
    cfg = load_config(None, [])
    older = cfg.to_dict()
    del older["model"]["z_loss_coeff"], older["model"]["bias_update_rate"]  # fields the older code lacked
    said = compare(cfg, older, tmp_path)
    assert len(said) == 1 and "saved before these model fields existed" in said[0]
    assert "read as their defaults: bias_update_rate=0.001, z_loss_coeff=0.0" in said[0]
    assert compare(cfg, cfg.to_dict(), tmp_path) == []  # the same recipe: nothing to say


def test_a_model_field_that_differs_still_refuses(tmp_path):
    now = load_config(None, ["model.norm_topk_prob=false"])
    older = now.to_dict()
    del older["model"]["norm_topk_prob"]  # absent: its default, true, is not the false asked for now
    with pytest.raises(CheckpointError, match=r"saved with a different model: model.norm_topk_prob: True in the "
                                              r"checkpoint, False now"):
        compare(now, older, tmp_path)
    saved = load_config(None, ["model.top_k=1"]).to_dict()  # present, with another value: as before
    with pytest.raises(CheckpointError, match="model.top_k: 1 in the checkpoint, 2 now"):
        compare(load_config(None, []), saved, tmp_path)


def test_a_changed_training_only_model_field_resumes_and_is_said(tmp_path):
    """The balancing loss's coefficient (or the z-loss, the bias rate, the init std) shapes no
    parameter and no forward: a resumed run may change it, from the resumed step on, and says so."""
    saved = load_config(None, ["model.aux_loss_coeff=0.001"]).to_dict()
    said = compare(load_config(None, ["model.z_loss_coeff=0.01"]), saved, tmp_path)
    assert len(said) == 1 and "recipe differs from the checkpoint's" in said[0]
    assert "model.aux_loss_coeff: 0.001 -> 0.01" in said[0] and "model.z_loss_coeff: 0.0 -> 0.01" in said[0]


def test_a_checkpoint_from_before_data_sampler_is_said_to_change_its_data_order(tmp_path):
    """Saved before data.sampler existed, a run drew random windows; resumed under the epochs
    sampler its order changes: said as that ('random' -> 'epochs'), not as a key that was None."""
    older = load_config(None, []).to_dict()
    del older["data"]["sampler"]
    said = compare(load_config(None, []), older, tmp_path)
    assert len(said) == 1 and "data.sampler: 'random' -> 'epochs'" in said[0], said
    assert compare(load_config(None, ["data.sampler=random"]), older, tmp_path) == []


@pytest.mark.parametrize("feature", ["data.document_mask=true", "train.eval_every=5"])
def test_parallel_auto_loads_with_features_that_exclude_cp_or_pp(feature):
    """Both once crashed at load ('>' between None and int: the checks read the sizes auto had not
    filled yet). Auto chooses only among layouts the feature supports, and the recipe keeps its
    unset sizes; a size given is checked once the layout is resolved (build.check_run)."""
    cfg = load_config(None, ["parallel.auto=true", feature])
    layouts = candidates(cfg, 4)
    assert layouts and all(lay["pp"] == 1 for lay in layouts)
    assert cfg.parallel.pp is None and check_run(resolve(cfg, 4)[0], torch.device("cpu"), 4).pp == 1
    if feature.startswith("data."):
        assert all(lay["cp"] == 1 for lay in layouts)
        given = resolve(load_config(None, ["parallel.auto=true", "parallel.cp=2", feature]), 4)[0]
        with pytest.raises(ConfigError, match="data.document_mask: not supported with parallel.cp > 1"):
            check_run(given, torch.device("cpu"), 4)
    assert max(lay["pp"] for lay in candidates(load_config(None, ["parallel.auto=true", "train.grad_accum=4"]), 4)) > 1


def test_context_parallel_refuses_a_variant_attention_naming_the_module(monkeypatch):
    """parallelize replaces each models.common.attention call (bound with the run's kernels) with
    context parallel's; build.check_run, before anything is built, refuses a variant's own."""
    cfg = load_config(None, ["model.num_layers=2", "parallel.cp=2"])
    dims = SimpleNamespace(fsdp_enabled=False, cp_enabled=True, cp_group=None, cp_rank=0, cp=2)
    m = use_kernels(build_model(cfg.model, init=False), one_gpu_kernels("auto", "cpu", bf16=False, fsdp=True, cp=True))
    plain = parallelize(m, dims, cfg.train, torch.device("cpu"), Precision())
    assert all(isinstance(layer.self_attn.attention, ContextParallelAttention) for layer in plain.layers)
    assert check_run(cfg, torch.device("cpu"), 2).cp == 2

    def block_sparse(q, k, v, **kw):
        return q

    def variant(model_cfg, init=True):  # a variant's attention in layer 1
        model = build_model(model_cfg, init=init)
        model.layers[1].self_attn.attention = block_sparse
        return model

    monkeypatch.setattr(build, "build_model", variant)
    with pytest.raises(ConfigError, match=r"parallel.cp=2: layers.1.self_attn.attention is "
                                          r".*block_sparse, not models.common.attention"):
        check_run(cfg, torch.device("cpu"), 2)


def test_export_refuses_a_model_field_hugging_faces_config_cannot_carry(tmp_path, monkeypatch, capsys):
    """GPT-OSS's swiglu_alpha: transformers fixes it at 1.702, so to_hf does not write it (it is not
    in GptOssConfig.hub_fields, the fields to_hf writes). Exported at another value, the model would
    load in transformers at 1.702, silently. save_hf and export-hf refuse it in one line naming the
    field, before writing anything; at its default, and with training-only fields changed, they write."""
    from pithtrain.checkpoint import export
    from pithtrain.checkpoint.hf import save_hf
    from pithtrain.models.gpt_oss import GptOssConfig
    needle = ("model.swiglu_alpha=1.5 would be lost: GptOssForCausalLM's config.json has no key for it "
              "(GptOssConfig.hub_fields), so transformers would build the model without it")
    with pytest.raises(ConfigError, match=re.escape(f"save_hf {tmp_path / 'hf'}: {needle}")):
        save_hf(build_model(GptOssConfig(num_layers=1, swiglu_alpha=1.5)), tmp_path / "hf")
    ckpt = tmp_path / "step_1"  # export-hf reads the model from the checkpoint's recipe
    ckpt.mkdir()
    (ckpt / RECIPE).write_text(yaml.safe_dump({"model": {"family": "gpt_oss", "num_layers": 1, "swiglu_alpha": 1.5}}))
    monkeypatch.setattr(export, "resolve", lambda c, check=None: ckpt)
    assert export.main(["--ckpt", str(ckpt), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {ckpt / RECIPE}: {needle}") and err.count("\n") == 1, err
    assert not (tmp_path / "hf").exists() and not (tmp_path / "out").exists()
    save_hf(build_model(GptOssConfig(num_layers=1, balance="sequence", z_loss_coeff=0.1)), tmp_path / "plain")
    assert (tmp_path / "plain" / "config.json").is_file()
