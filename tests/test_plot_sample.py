"""`invoke plot` and `invoke sample` on a tiny trained run."""

import json
import subprocess
import sys

import pytest

from pithtrain.config import load_config
from pithtrain.metrics import PANELS, plot_run
from pithtrain.train import train

TINY = ["train.steps=40", "train.micro_batch_size=4", "train.seq_len=64", "train.warmup_steps=5",
        "model.hidden_size=64", "model.num_heads=4", "model.head_dim=16", "model.moe_intermediate_size=64",
        "model.num_layers=2", "data.max_bytes=300000", "log.every=10", "train.eval_every=20",
        "train.eval_batches=1"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("plot") / "run"
    train(load_config(None, TINY + [f"log.run_dir={d}"]))
    return d


def test_plot_draws_the_logged_arrays(run_dir, tmp_path):
    out = tmp_path / "curves.png"
    fig = plot_run(run_dir, out)
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 50_000  # four drawn panels (empty ones: ~46 KB)
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [ax.get_title() for ax in fig.axes] == [t for _, t in PANELS]
    for ax, (key, _) in zip(fig.axes, PANELS):
        (line,) = ax.get_lines()
        want = [(r["step"], r[key]) for r in recs if key in r]
        assert [tuple(p) for p in line.get_xydata().tolist()] == want, key
    assert [s for s, _ in fig.axes[1].get_lines()[0].get_xydata()] == [20, 40]  # val_loss at the evaluations


def test_plot_command_writes_the_png(run_dir):
    from pithtrain.metrics import main
    assert main([str(run_dir)]) == 0 and (run_dir / "metrics.png").stat().st_size > 50_000
    assert main([str(run_dir / "nothing")]) == 2


@pytest.mark.quick
def test_sample_prints_text_and_greedy_is_deterministic(run_dir, capsys):
    from pithtrain.sample import ByteTokenizer, generate, load_run, main

    model, tok, context = load_run(run_dir)
    assert isinstance(tok, ByteTokenizer) and context == 64
    ids = tok.encode("def ")
    a = generate(model, ids, 30, 0.0, context)
    assert a == generate(model, ids, 30, 0.0, context) and len(a) == 30
    assert generate(model, ids, 30, 1.0, context, seed=1) != generate(model, ids, 30, 1.0, context, seed=2)
    assert main(["--ckpt", str(run_dir), "--prompt", "import ", "--tokens", "40", "--temperature", "0"]) == 0
    first = capsys.readouterr().out
    assert main(["--ckpt", str(run_dir), "--prompt", "import ", "--tokens", "40", "--temperature", "0"]) == 0
    assert capsys.readouterr().out == first and first.startswith("import ") and len(first) > len("import ") + 5
    # the trained model writes bytes like the stdlib's Python source: mostly printable ASCII
    text = tok.decode(a)
    assert sum(ch.isprintable() or ch in "\n\t" for ch in text) >= 0.9 * len(text), text


def test_sample_errors_are_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pithtrain.sample", "--ckpt", str(tmp_path)],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "Traceback" not in r.stderr
