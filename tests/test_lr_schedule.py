"""train.lr_schedule: each schedule against its formula, and resuming a warmup-stable-decay run
with a longer train.steps: the stable phase is extended, exactly as if the run had been that long
from the start (what WSD is for); a cosine one is re-stretched, and resume says the LR moved."""

import math

import pytest
import torch

from pithtrain.build import build_optimizer, lr_lambda
from pithtrain.checkpoint.dcp import Checkpointer
from pithtrain.config import load_config
from pithtrain.models import build_model
from pithtrain.train import train

M = 0.1  # min_lr_ratio
LEFT = {"linear": lambda p: 1 - p, "cosine": lambda p: 0.5 * (1 + math.cos(math.pi * p)),
        "sqrt": lambda p: 1 - math.sqrt(p)}  # the share of the decay still to go at progress p


def factor(*overrides):
    return lr_lambda(load_config(None, ["train.steps=100", "train.warmup_steps=10", f"train.min_lr_ratio={M}",
                                        *overrides]))


@pytest.mark.parametrize("schedule, decay_type, decay_from", [
    ("cosine", "cosine", 10), ("linear", "linear", 10), ("constant", None, 100),
    ("wsd", "linear", 80), ("wsd", "cosine", 80), ("wsd", "sqrt", 80)])
def test_each_schedule_follows_its_formula(schedule, decay_type, decay_from):
    """Warmup (s + 1) / warmup_steps, then 1 until the decay starts (cosine and linear: at once; wsd:
    at steps * (1 - decay_ratio); constant: never), then min + (1 - min) * left(progress)."""
    f = factor(f"train.lr_schedule={schedule}", *([f"train.decay_type={decay_type}"] if schedule == "wsd" else []))
    for s in range(100):
        want = ((s + 1) / 10 if s < 10 else 1.0 if s < decay_from else
                M + (1 - M) * LEFT[decay_type]((s - decay_from) / (100 - decay_from)))
        assert f(s) == pytest.approx(want, rel=1e-12, abs=1e-15), (s, f(s), want)
    assert f(100) == pytest.approx(1.0 if schedule == "constant" else M)  # train.steps: the end of the decay
    half = {"linear": 0.55, "cosine": 0.55, "sqrt": 1 - 0.9 * math.sqrt(0.5), None: 1.0}[decay_type]  # by hand
    assert f(decay_from + (100 - decay_from) // 2) == pytest.approx(half if schedule != "constant" else 1.0)


TINY = ["train.micro_batch_size=2", "train.seq_len=32", "train.warmup_steps=2", "model.hidden_size=32",
        "model.num_heads=2", "model.num_kv_heads=1", "model.head_dim=16", "model.moe_intermediate_size=32",
        "model.num_layers=2", "data.max_bytes=20000", "log.every=1", "log.tensorboard=false",
        "train.lr_schedule=wsd", "train.decay_ratio=0.25"]


def test_resuming_a_wsd_run_with_more_steps_extends_its_stable_phase(tmp_path, capsys):
    """A 6-step run (decaying after step 5) checkpointed at step 3, resumed with train.steps=12
    (decaying after step 10): its steps 4-12 are those of a 12-step run from the start, lr and loss
    bit for bit, stable at step 6 where the short run was decaying."""
    lr = load_config(None, TINY).train.lr
    long_run, _ = train(load_config(None, TINY + ["train.steps=12", f"log.run_dir={tmp_path / 'a'}"]))
    short, _ = train(load_config(None, TINY + ["train.steps=6", "checkpoint.every=3", f"log.run_dir={tmp_path / 'b'}"]))
    assert [r["lr"] for r in short[2:]] == pytest.approx([lr, lr, lr, lr * (M + (1 - M) * 0.5)])
    assert [r["lr"] for r in long_run[2:10]] == [lr] * 8 and long_run[-1]["lr"] < lr
    capsys.readouterr()
    resumed, _ = train(load_config(None, TINY + ["train.steps=12", f"log.run_dir={tmp_path / 'b'}"]),
                       resume=str(tmp_path / "b/checkpoints/step_3"))
    out = capsys.readouterr().out
    assert "resumed from" in out and "train.steps: 6 -> 12" in out and "the LR at step" not in out
    assert [r["step"] for r in resumed] == list(range(4, 13))
    assert [(r["lr"], r["loss"]) for r in resumed] == [(r["lr"], r["loss"]) for r in long_run[3:]]

    # a cosine run resumed with more steps: the schedule is the recipe's, so its LR moves up, and it says so
    cfg = load_config(None, TINY + ["train.steps=24", "train.lr_schedule=cosine", "train.decay_ratio=0.2",
                                    f"log.run_dir={tmp_path / 'c'}"])
    model = build_model(cfg.model, "cpu")
    opt = build_optimizer(model, cfg, torch.device("cpu"))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    Checkpointer(cfg, model, opt, sched, torch.device("cpu")).load(tmp_path / "b/checkpoints/step_3")
    want = lr * lr_lambda(cfg)(3)
    assert sched.get_last_lr() == [want, want] and want < lr
    assert f"checkpoint: the LR at step 3 is {want:.3e}, not the checkpoint's {lr:.3e}: train.lr_schedule cosine " \
           "over train.steps 24 applies from here" in capsys.readouterr().out
