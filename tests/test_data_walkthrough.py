"""The data walkthrough of the docs, run as written: the fenced bash block of DOC, on a corpus and a
tokenizer this test makes, with only the model's size and the step count added to `invoke train`;
then `sample` and `export-hf` from another working directory, and transformers loads the export
with its tokenizer. The commands are read from the doc, so the doc and the test cannot drift.

Each line goes through invoke itself (one `invoke ... --dry-run` process for the four: tasks.py
turns each into its `python -m pithtrain.X ...` line), and that line runs in this process through
the module's `main`, in the line's working directory: the same arguments, one torch import.
"""

import importlib
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pithtrain.config import load_config

ROOT = Path(__file__).resolve().parent.parent
DOC = "docs/data.md"  # where the walkthrough lives (its first ```bash block)
# Added to the doc's `invoke train` line: a tiny model for a few seconds on two cores.
TINY = ["train.steps=4", "train.micro_batch_size=2", "train.seq_len=32", "train.warmup_steps=2",
        "log.every=2", "model.hidden_size=32", "model.num_heads=2", "model.num_kv_heads=1", "model.head_dim=16",
        "model.moe_intermediate_size=32", "model.num_layers=2", "train.eval_batches=1", "log.tensorboard=false"]
WORDS = "the quick brown fox jumps over a lazy dog while seven small cats sleep under warm red blankets".split()


def doc_commands() -> list[list[str]]:
    text = (ROOT / DOC).read_text()
    block = re.search(r"^```bash\n(.*?)^```", text, re.S | re.M)[1]
    return [shlex.split(line.split(" #")[0]) for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def make_corpus(work: Path):
    """Whatever the doc's prepare-data line names: a parquet file, JSON lines named .json, a
    directory of .txt files, and a small byte-level BPE trained on the same text."""
    datasets = pytest.importorskip("datasets")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    def doc(i):
        return " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(40)) + "."

    texts = {"parquet": [doc(i) for i in range(60)], "json": [doc(i) for i in range(60, 100)],
             "txt": [doc(i) for i in range(100, 105)]}
    (work / "corpus" / "notes").mkdir(parents=True)
    datasets.Dataset.from_dict({"text": texts["parquet"]}).to_parquet(str(work / "corpus" / "train.parquet"))
    (work / "corpus" / "extra.json").write_text("\n".join(json.dumps({"text": t}) for t in texts["json"]))
    for i, t in enumerate(texts["txt"]):
        (work / "corpus" / "notes" / f"{i}.txt").write_text(t)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator([t for v in texts.values() for t in v], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    (work / "tok").mkdir()
    tok.save(str(work / "tok" / "tokenizer.json"))
    return tok, sum(len(v) for v in texts.values())


def translate(cmds: list[list[str]]) -> list[list[str]]:
    """The `python -m MODULE ARGS` line invoke runs for each `invoke TASK ...` command."""
    assert all(c[0] == "invoke" for c in cmds)  # invoke finds tasks.py in the checkout; here it is told where
    words = [w for c in cmds for w in [*c[1:], "--dry-run"]]
    r = subprocess.run([sys.executable, "-m", "invoke", "--search-root", str(ROOT), *words],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = [shlex.split(line) for line in r.stdout.splitlines()]
    assert [line[:2] for line in lines] == [[sys.executable, "-m"]] * len(cmds), r.stdout
    return [line[2:] for line in lines]


def run(line: list[str], cwd: Path, monkeypatch, capsys) -> str:
    """`python -m MODULE ARGS` through MODULE.main(ARGS), in `cwd`; returns its stdout."""
    monkeypatch.chdir(cwd)
    capsys.readouterr()
    rc = importlib.import_module(line[0]).main(line[1:])
    out, err = capsys.readouterr()
    assert rc == 0, (line, out[-3000:], err[-3000:])
    return out


def test_the_docs_data_walkthrough_runs_as_written(tmp_path, monkeypatch, capsys):
    transformers = pytest.importorskip("transformers")
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir()
    elsewhere.mkdir()
    tok, n_docs = make_corpus(work)
    cmds = doc_commands()
    assert [c[:2] for c in cmds] == [["invoke", "prepare-data"], ["invoke", "train"], ["invoke", "sample"],
                                     ["invoke", "export-hf"]], cmds
    # the walkthrough's run has a directory of its own: the Quick start's (the default recipe's) holds a
    # stdlib-bytes run, onto which this one would not resume
    run_dir = next(w.split("=", 1)[1] for w in cmds[1] if w.startswith("log.run_dir="))
    assert run_dir != load_config(None).log.run_dir and [c[c.index("--ckpt") + 1] for c in cmds[2:]] == [run_dir] * 2
    ckpt = str(work / run_dir)  # sample and export run elsewhere: the run dir named from there
    cmds[1] += [f"--set={o}" for o in TINY]
    cmds[2:] = [[ckpt if w == run_dir else w for w in c] for c in cmds[2:]]
    prepare, train, sample, export = translate(cmds)
    assert [prepare[0], train[0], sample[0], export[0]] == ["pithtrain.data", "pithtrain.train", "pithtrain.sample",
                                                            "pithtrain.checkpoint.export"]
    out = run(prepare, work, monkeypatch, capsys)
    assert re.search(rf"prepare-data: {n_docs} documents, [\d,]+ tokens in 1 shard\(s\) \(uint16\) -> data/train; "
                     r"vocabulary 300, EOS '<\|endoftext\|>' \(id 0\)", out), out
    out = run(train, work, monkeypatch, capsys)
    assert re.search(rf"pithtrain: data: shards data/train \([\d.]+M tokens, {n_docs} documents; tokenizer tok/ "
                     r"sha256 [0-9a-f]{12}, vocabulary 300, EOS id 0\); validation: the last 1% held out", out), out
    assert "pithtrain: model.vocab_size: auto -> 320 (data/train/meta.json vocab_size 300" in out
    assert re.search(r"pithtrain: done: 4 steps \(4 in this process\), [\d.]+M tokens seen \([\d.]+ epochs of "
                     rf"[\d.]+M\), loss [\d.]+, val_loss [\d.]+, \d+ s; checkpoint {run_dir}/checkpoints/step_4", out)

    # From another directory, on the checkpoint alone (its recipe's data.path is relative to `work`)
    prompt = sample[sample.index("--prompt") + 1]
    assert run(sample, elsewhere, monkeypatch, capsys).startswith(prompt)
    assert "export: tokenizer from" in run(export, elsewhere, monkeypatch, capsys)
    hf = elsewhere / export[export.index("--out") + 1]
    eos = tok.token_to_id("<|endoftext|>")  # the separator; the BPE's post-processor adds no BOS
    assert transformers.GenerationConfig.from_pretrained(hf).eos_token_id == eos
    assert {"eos_token_id": eos, "pad_token_id": eos}.items() <= json.loads((hf / "config.json").read_text()).items()
    theirs_tok = transformers.AutoTokenizer.from_pretrained(hf)
    assert theirs_tok(prompt).input_ids == tok.encode(prompt).ids and theirs_tok.eos_token == "<|endoftext|>"
    from pithtrain.checkpoint.export import load_checkpoint_model
    ids = torch.tensor([tok.encode(" ".join(WORDS)).ids])
    theirs = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)(ids).logits
    ours = load_checkpoint_model(ckpt)(ids)
    torch.testing.assert_close(theirs, ours, rtol=0.05, atol=0.05)  # the export is bfloat16

    # ... and train.init_from takes the export with its tokenizer: the shards' fingerprint matches it,
    # and shards without a tokenizer.json (made by hand) get the checkpoint's into the run's checkpoints
    from pithtrain.train import train
    bare = tmp_path / "bare"
    shutil.copytree(work / "data" / "train", bare)
    (bare / "tokenizer.json").unlink()
    cfg = load_config(None, [f"train.init_from={hf}", "data.source=shards", f"data.path={bare}",
                             f"log.run_dir={tmp_path / 'tuned'}", *[o for o in TINY if not o.startswith("model.")]])
    assert cfg.model.vocab_size == 320
    train(cfg)
    assert (tmp_path / "tuned/checkpoints/step_4/tokenizer.json").read_bytes() == (hf / "tokenizer.json").read_bytes()
