"""Watching a run: validation loss, TensorBoard events consistent on resume, phase lines and ETA."""

import json
import math
import re

import numpy as np
import pytest
import torch

from pithtrain.config import ConfigError, load_config
from pithtrain.data import build_batches
from pithtrain.train import main, train
from tests.test_data import write_shards


def read_events(run_dir) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] of every scalar event in the run's TensorBoard files, read raw (no
    reader-side purging of stale steps), in file order."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event

    out = {}
    for f in sorted((run_dir / "tensorboard").glob("events.out.tfevents.*")):
        for raw in RawEventFileLoader(str(f)).Load():
            e = Event.FromString(raw)
            for v in e.summary.value:
                out.setdefault(v.tag, []).append((e.step, v.simple_value))
    return out


def test_val_loss_is_the_held_out_loss_in_the_record_stream(tiny_overrides, tmp_path):
    cfg = load_config(None, tiny_overrides + ["train.eval_every=15", "train.eval_batches=2"])
    hist, model = train(cfg)
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [10, 15, 20, 30]  # log.every 10, plus the evaluation at 15
    assert [r["step"] for r in recs if "val_loss" in r] == [15, 30]
    assert [h["step"] for h in hist if "val_loss" in h] == [15, 30]
    assert recs[1]["val_loss"] > recs[3]["val_loss"] and all(math.isfinite(r.get("val_loss", 0)) for r in recs)
    # the final value is the trained model's mean token loss on the held-out windows
    batches = build_batches(cfg.data, cfg.train.seq_len, cfg.train.micro_batch_size, cfg.train.seed, hold_out=True)
    model = model.eval()
    loss = n = 0
    with torch.no_grad():
        for i in range(2):
            x, y = batches.val_batch(i)
            loss, n = loss + model(x, labels_BS=y).item(), n + y.numel()
    assert recs[3]["val_loss"] == pytest.approx(loss / n, rel=1e-5)
    assert read_events(tmp_path / "run")["val_loss"] == [(15, pytest.approx(recs[1]["val_loss"])),
                                                        (30, pytest.approx(recs[3]["val_loss"]))]


def test_hold_out_only_when_evaluating(tiny_overrides, tmp_path):
    cfg = load_config(None, tiny_overrides)
    off = build_batches(cfg.data, 64, 4, 0)
    on = build_batches(cfg.data, 64, 4, 0, hold_out=True)
    assert off.n_train == len(off.tokens) and on.n_train == len(on.tokens) - len(on.tokens) // 100
    with pytest.raises(RuntimeError, match="no validation data"):
        off.val_batch(0)
    starts_on_val = on.val_batch(0)[0]
    held = torch.from_numpy(on.tokens[on.n_train:].astype("int64"))
    for row in starts_on_val:  # every validation window lies in the held-out tail
        assert any(torch.equal(held[s:s + 64], row) for s in range(len(held) - 64))
    train_dir = write_shards(tmp_path / "t", [np.arange(5000) % 200])
    val_dir = write_shards(tmp_path / "val", [np.full(300, 7)])
    shard_cfg = load_config(None, tiny_overrides + ["data.source=shards", f"data.path={train_dir}",
                                                    "train.eval_every=10", f"data.val_path={val_dir}"])
    own = build_batches(shard_cfg.data, 64, 4, 0, hold_out=True)
    assert own.n_train == 5000 and (own.val_batch(1)[0] == 7).all()  # data.val_path: nothing held out
    with pytest.raises(ConfigError, match="data.val_path: is read only by evaluation on shards"):
        load_config(None, tiny_overrides + [f"data.val_path={write_shards(tmp_path / 'v', [range(300)])}"])


def test_resumed_run_has_each_step_once_in_metrics_and_tensorboard(tiny_overrides, tmp_path):
    """A run that went past its last checkpoint (step 20) to 25 and stopped; the resumed run
    redoes 25 and goes on to 30. metrics.jsonl and the TensorBoard events each hold every logged
    step once, with the resumed run's values."""
    base = [o for o in tiny_overrides if not o.startswith(("train.steps", "log.every"))]
    base += ["log.every=5", "checkpoint.every=10"]
    train(load_config(None, base + ["train.steps=25", "checkpoint.final=false"]))
    first = read_events(tmp_path / "run")["loss"]
    assert [s for s, _ in first] == [5, 10, 15, 20, 25]
    train(load_config(None, base + ["train.steps=30"]))
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [5, 10, 15, 20, 25, 30]
    assert [r["step"] for r in recs] == steps
    events = read_events(tmp_path / "run")
    assert [s for s, _ in events["loss"]] == steps
    assert [v for _, v in events["loss"]] == [pytest.approx(r["loss"]) for r in recs]
    assert [s for s, _ in events["tokens_per_s"]] == steps
    assert events["loss"][:4] == first[:4]  # what the checkpoint covers is kept as it was


def test_startup_phases_and_eta_are_printed(tiny_overrides, capsys):
    assert main(tiny_overrides + ["log.tensorboard=false"]) == 0
    out = capsys.readouterr().out
    for line in ("pithtrain: building the model: ", "pithtrain: loading the checkpoint and data: ",
                 "pithtrain: first step ...", "pithtrain: first step: "):
        assert line in out, line
    assert out.index("first step ...") < out.index("first step: ") < out.index("step     10 |")
    step_lines = {ln[:11]: ln for ln in out.splitlines() if ln.startswith("step ")}
    assert step_lines["step     30"].endswith("| ETA 0m00s")  # nothing left
    assert re.search(r" \| ETA \d+m\d\ds$", step_lines["step     10"])


def test_wandb_is_refused_when_not_installed(tiny_overrides, monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"log.wandb: needs the wandb package \(pip install wandb\), or set "
                                          r"log.wandb=null"):
        load_config(None, tiny_overrides + ["log.wandb=myproject"])
    load_config(None, tiny_overrides)  # unset: nothing needed
