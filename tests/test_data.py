import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from pithtrain.config import ConfigError, load_config
from pithtrain.data import (
    BOS,
    DATA_VOCAB_SIZE,
    EOS,
    ShardedTokens,
    TokenBatches,
    build_batches,
    prepare_data,
    rows,
    shard_tokens,
    stdlib_tokens,
    windows,
)


def test_stdlib_tokens_are_bytes_with_document_markers():
    t = stdlib_tokens(200_000)
    assert len(t) >= 200_000 and t.max() < DATA_VOCAB_SIZE
    assert t[0] == BOS and (t == EOS).sum() >= 1
    # the bytes between the first BOS/EOS are a real Python source file
    end = int(np.argmax(t == EOS))
    text = bytes(t[1:end].astype(np.uint8)).decode("utf-8", errors="replace")
    assert "import" in text or "def " in text or '"""' in text


@pytest.mark.quick
def test_batches_are_deterministic_and_shifted():
    t = stdlib_tokens(100_000)
    b = TokenBatches(t, seq_len=32, global_batch=4, seed=7)
    x1, y1 = b.batch(3)
    x2, y2 = TokenBatches(t, 32, 4, 7).batch(3)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert x1.shape == (4, 32) and x1.dtype == torch.int64
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # labels are the next tokens
    assert not torch.equal(b.batch(4)[0], x1)
    xv, _ = b.val_batch()
    assert xv.shape == (4, 32)


def _label_positions(b: TokenBatches, steps: range) -> list[int]:
    """The token positions the labels of these steps' batches cover (tokens are their positions)."""
    ys = torch.cat([b.batch(s)[1] for s in steps]).flatten()
    return ys[ys != -100].tolist()


@pytest.mark.quick
def test_an_epoch_is_one_pass_over_the_windows_in_a_seeded_order():
    """The sampler drew windows with replacement: at "1.21 epochs" 29.5% of the positions had never
    been in a batch. Now an epoch covers every window position once (the last partial window's
    tokens in none), each epoch in its own order, a function of (seed, step) alone."""
    S, G, n = 16, 8, 2003
    t = np.arange(n, dtype=np.uint16)
    b = TokenBatches(t, S, G, seed=3, hold_out=False)
    W = len(b.starts)
    assert W == (n - 1) // S == 125 and b.epochs(W) == G
    stream = torch.cat([b.batch(s)[1] for s in range(2 * W // G + 1)])  # past two epochs (W is not a multiple of G)
    first, second = stream[:W], stream[W:2 * W]
    for epoch in (first, second):
        assert sorted(epoch.flatten().tolist()) == list(range(1, W * S + 1))  # each label position once
    assert not torch.equal(first, second) and not torch.equal(first[:, 0], torch.arange(W) * S + 1)  # shuffled
    again = TokenBatches(t, S, G, seed=3, hold_out=False)  # a resumed run: no history, the same batch
    assert all(torch.equal(again.batch(s)[0], b.batch(s)[0]) for s in (2 * W // G, 0, 17))
    assert not torch.equal(TokenBatches(t, S, G, seed=4, hold_out=False).batch(0)[0], b.batch(0)[0])
    # the sampler before, named: random starts, with replacement
    old = TokenBatches(t, S, G, seed=3, hold_out=False, sampler="random")
    g = torch.Generator().manual_seed(3 * 1_000_003 + 5)
    starts = torch.randint(0, n - S - 1, (G,), generator=g)
    assert torch.equal(old.batch(5)[0], torch.stack([torch.arange(s, s + S) for s in starts.tolist()]))
    assert old.epochs(100) == pytest.approx(100 * G * S / n)


@pytest.mark.quick
def test_document_masking_windows_hold_whole_documents_and_cover_each_position_once():
    """With document masking a window starts at a document's first token and stops at the last
    document end it reaches (padded, no loss), but for a document longer than a window, which
    continues in the next; over an epoch every position is a label once, but a document's first token
    where it starts a window (predicting it from the previous document's separator: no loss there)."""
    rng = np.random.default_rng(0)
    S, eos, lengths = 32, 1, rng.integers(2, 90, 60)  # documents shorter and longer than a window
    t = np.arange(2, 2 + lengths.sum(), dtype=np.uint16)
    t[np.cumsum(lengths) - 1] = eos  # each document ends with its separator
    starts, lens = windows(t, len(t), S, eos)
    assert starts[0] == 0 and (lens <= S + 1).all()
    for i, (s, n) in enumerate(zip(starts, lens)):
        w = t[s:s + n]
        # a document's first token, or inside one longer than a window: the previous window is cut, full
        assert i == 0 or t[s - 1] == eos or (lens[i - 1] == S + 1 and starts[i - 1] + S == s)
        # it ends with a document's separator (or the data), or it holds no document end: cut
        assert w[-1] == eos or s + n == len(t) or (n == S + 1 and not (w[:-1] == eos).any())
    assert sum(t[s - 1] != eos for s in starts[1:]) > 5  # long documents were cut
    firsts = set(starts.tolist())
    labels = sorted(p for s, n in zip(starts, lens) for p in range(s + 1, s + n))
    assert labels == [p for p in range(1, len(t)) if not (p in firsts and t[p - 1] == eos)]  # a cut: in both
    b = TokenBatches(t, S, 4, seed=0, hold_out=False, eos=eos, align=True)
    W = len(b.starts)
    x, y = map(torch.cat, zip(*[b.batch(i) for i in range(-(-W // 4))]))
    assert sorted(y[:W][y[:W] != -100].tolist()) == sorted(int(t[p]) for p in labels)  # one epoch: each once
    assert ((x == eos) | (y != -100)).all()  # padding is separators, and carries no loss


def test_one_epoch_honours_prepare_datas_mixture_weights(tmp_path, tokenizer_dir):
    """--weights 2,1: one epoch's labels hold each input's tokens as meta.json counts them (to
    within the part of one window the epoch leaves out)."""
    from tokenizers import Tokenizer

    a, b_ = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("\n".join(json.dumps({"text": "hello " * (i % 5 + 1)}) for i in range(40)))
    b_.write_text("\n".join(json.dumps({"text": "world " * (i % 3 + 1)}) for i in range(60)))
    meta = prepare_data([str(a), str(b_)], str(tokenizer_dir), str(tmp_path / "o"), progress=False,
                        weights=[2.0, 1.0])
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    hello, world = (tok.encode(w).ids[0] for w in ("hello", " world"))
    S, G = 16, 4
    b = TokenBatches(shard_tokens(tmp_path / "o"), S, G, seed=1, hold_out=False)
    W = len(b.starts)
    y = torch.cat([b.batch(i)[1] for i in range(-(-W // G))])[:W]
    whole = np.asarray(shard_tokens(tmp_path / "o")[:])
    for word in (hello, world):
        assert int((whole == word).sum()) - S <= int((y == word).sum()) <= int((whole == word).sum())
    assert meta["inputs"][0]["documents"] == 80


@pytest.mark.quick
def test_rows_partition_the_global_batch():
    seen = []
    for micro in range(3):
        for r in range(2):
            s = rows(micro, r, 2, 4)
            seen += list(range(s.start, s.stop))
    assert sorted(seen) == list(range(24))


# (dp, fsdp, cp, grad_accum, micro_batch_size): 8 rows per step in every layout
LAYOUTS = [(1, 1, 1, 4, 2), (1, 1, 1, 1, 8), (2, 1, 1, 2, 2), (4, 1, 1, 1, 2), (2, 1, 1, 4, 1),
           (2, 2, 1, 1, 2), (1, 2, 2, 2, 2), (2, 1, 4, 1, 4)]


@pytest.mark.quick
@pytest.mark.parametrize("dp,fsdp,cp,grad_accum,mbs", LAYOUTS)
def test_every_layout_reads_the_single_rank_batch(dp, fsdp, cp, grad_accum, mbs):
    """The step's tokens are the same whatever the layout: each rank builds its own TokenBatches
    and takes what train.py takes (data.rows of its batch rank for each micro-batch, then its cp
    chunks); the shards, put back by micro-batch, batch rank and cp positions, are exactly the one
    rank, one micro-batch global batch, and each token is read once per batch rank."""
    from pithtrain.distributed.context_parallel import split_batch
    from pithtrain.distributed.parallel_dims import ParallelDims

    t, S, G, step = stdlib_tokens(100_000), 16, 8, 5
    ref_x, ref_y = TokenBatches(t, S, G, seed=7).batch(step)
    world = dp * fsdp * cp
    x, y, seen = torch.full_like(ref_x, -1), torch.full_like(ref_y, -1), torch.zeros_like(ref_x)
    for rank in range(world):
        dims = ParallelDims(dp=dp, fsdp=fsdp, cp=cp, world_size=world, rank=rank)
        assert mbs * grad_accum * dims.data_parallel_size == G  # train.py's global batch
        x_GS, y_GS = TokenBatches(t, S, G, seed=7).batch(step)
        for micro in range(grad_accum):
            r = rows(micro, dims.data_parallel_rank, dims.data_parallel_size, mbs)
            x_BS, y_BS, pos_BS = split_batch(x_GS[r], y_GS[r], dims)
            pos_BS = torch.arange(S).expand_as(x_BS) if pos_BS is None else pos_BS
            assert x_BS.shape == (mbs, S // cp)
            x[r] = x[r].scatter(1, pos_BS, x_BS)
            y[r] = y[r].scatter(1, pos_BS, y_BS)
            seen[r] = seen[r].scatter_add(1, pos_BS, torch.ones_like(pos_BS))
    assert torch.equal(seen, torch.ones_like(seen))
    assert torch.equal(x, ref_x) and torch.equal(y, ref_y)


def test_too_little_data_is_an_error():
    with pytest.raises(ConfigError, match=r"only 50 tokens, too few for train.seq_len 64 .*>= 131"):
        TokenBatches(np.zeros(50, dtype=np.uint16), seq_len=64, global_batch=2, seed=0)
    TokenBatches(np.zeros(131, dtype=np.uint16), seq_len=64, global_batch=2, seed=0).batch(0)  # the least


def write_shards(d, arrays, **meta):
    """A shard directory as prepare_data writes it, from token arrays; `meta` replaces meta.json fields."""
    d.mkdir()
    files = []
    for i, a in enumerate(arrays):
        np.asarray(a, dtype=np.uint16).tofile(d / f"shard_{i:05d}.bin")
        files.append({"name": f"shard_{i:05d}.bin", "tokens": len(a)})
    meta = {"dtype": "uint16", "vocab_size": DATA_VOCAB_SIZE, "files": files, **meta}
    (d / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if v is not None}))
    return d


def test_shards_stay_memory_mapped_and_read_like_their_concatenation(tmp_path):
    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, DATA_VOCAB_SIZE, n) for n in (300, 7, 1, 250)]  # windows span up to 3 shards
    toks = shard_tokens(write_shards(tmp_path / "s", arrays))
    assert isinstance(toks, ShardedTokens) and len(toks.shards) == 4
    assert all(isinstance(a, np.memmap) for a in toks.shards)  # nothing read into memory up front
    whole = np.concatenate(arrays).astype(np.uint16)
    assert len(toks) == len(whole)
    for s in range(len(whole) - 8):  # every window of 9, inside a shard and across each boundary
        assert np.array_equal(toks[s:s + 9], whole[s:s + 9]), s
    assert toks[301] == whole[301] and toks[-1] == whole[-1] and len(toks[5:5]) == 0
    assert np.array_equal(toks[500:10_000], whole[500:])  # slices clip like numpy's
    for step in range(3):
        for a, b in zip(TokenBatches(toks, 64, 8, 3).batch(step), TokenBatches(whole, 64, 8, 3).batch(step)):
            assert torch.equal(a, b)


def test_shard_vocabulary_must_fit_the_model(tmp_path):
    def load(name, **meta):
        d = write_shards(tmp_path / name, [np.arange(200)], **meta)
        return load_config(None, ["data.source=shards", f"data.path={d}"])  # default model.vocab_size 264

    assert load("fits", vocab_size=264).model.vocab_size == 264
    with pytest.raises(ConfigError, match=r"model.vocab_size: 264 is smaller than the vocabulary of the token "
                                          r"shards in '.*big' \(300, from meta.json\)"):
        load("big", vocab_size=300)
    with pytest.raises(ConfigError, match=r"data.path: .*unknown/meta.json: no vocab_size"):
        load("unknown", vocab_size=None)


@pytest.mark.parametrize("break_it, needle", [
    (lambda d: (d / "meta.json").write_text('{"dtype": "uint16", "vocab_size": 258}'),
     r"meta.json: files must be a non-empty list"),
    (lambda d: (d / "meta.json").write_text("{not json"), r"meta.json: not valid JSON"),
    (lambda d: (d / "shard_00001.bin").unlink(), r"shard_00001.bin: shard listed in .*meta.json is missing"),
    (lambda d: (d / "shard_00000.bin").write_bytes(b"\0" * 10),
     r"shard_00000.bin: truncated or wrong-size shard: 10 bytes, .*meta.json says 100 tokens \(200 bytes\)"),
])
def test_bad_shard_directory_is_a_config_error_naming_the_file(tmp_path, break_it, needle):
    d = write_shards(tmp_path / "s", [np.arange(100), np.arange(100)])
    break_it(d)
    with pytest.raises(ConfigError, match=needle):
        shard_tokens(d)
    with pytest.raises(ConfigError, match="data.path: .*" + needle):  # at load time, before any model is built
        load_config(None, ["data.source=shards", f"data.path={d}"])


def test_too_few_shard_tokens_names_the_directory(tmp_path):
    d = write_shards(tmp_path / "s", [np.arange(50), np.arange(30)])
    cfg = load_config(None, ["data.source=shards", f"data.path={d}", "train.seq_len=64"])
    with pytest.raises(ConfigError, match=rf"data.path '{d}': only 80 tokens, too few for train.seq_len 64 "
                                          r"\(one window each for training and validation needs >= 131\)"):
        build_batches(cfg.data, 64, 4, 0, hold_out=True)  # evaluation on: 1% held out
    build_batches(cfg.data, 64, 4, 0)  # evaluation off: nothing held out, one window of 65 fits
    with pytest.raises(ConfigError, match=r"only 60 tokens, too few for train.seq_len 64 \(one window each "
                                          r"for training needs >= 66\)"):
        build_batches(load_config(None, ["data.source=shards",
                                         f"data.path={write_shards(tmp_path / 't', [np.arange(60)])}",
                                         "train.seq_len=64"]).data, 64, 4, 0)


def test_data_errors_end_the_run_with_one_line(tmp_path, capsys, tiny_overrides):
    from pithtrain.train import main

    d = write_shards(tmp_path / "s", [np.arange(60)])
    assert main([*tiny_overrides, "data.source=shards", f"data.path={d}"]) == 2
    err = capsys.readouterr().err
    assert "error: data.path" in err and "too few for train.seq_len 64" in err and "Traceback" not in err


@pytest.fixture
def tokenizer_dir(tmp_path):
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<|endoftext|>"])
    tok.train_from_iterator(["hello world, this is pithtrain"] * 50, trainer)
    d = tmp_path / "tok"
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    return d


def test_prepare_data_jsonl_and_text_round_trip(tmp_path, tokenizer_dir):
    from tokenizers import Tokenizer

    src = tmp_path / "docs.jsonl"
    src.write_text("\n".join(json.dumps({"text": f"hello world {i}"}) for i in range(300)))
    txt = tmp_path / "one.txt"
    txt.write_text("this is pithtrain")
    out = tmp_path / "shards"
    meta = prepare_data([str(src), str(txt)], str(tokenizer_dir), str(out), shard_tokens_max=500,
                        progress=False)
    assert meta["documents"] == 301 and len(meta["files"]) > 1
    # a shard closes at the first document that takes it to shard_tokens_max (documents here are short)
    assert all(500 <= f["tokens"] < 520 for f in meta["files"][:-1]), meta["files"]
    toks = shard_tokens(out)
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    first = [int(i) for i in toks[: list(toks).index(eos)]]
    assert first == tok.encode("hello world 0").ids
    assert sum(f["tokens"] for f in meta["files"]) == len(toks)


def test_prepare_data_errors_name_the_file(tmp_path, tokenizer_dir, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: no 'text' field"):
        prepare_data([str(bad)], str(tokenizer_dir), str(tmp_path / "o"), progress=False)
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        prepare_data([str(tmp_path / "missing.txt")], str(tokenizer_dir), str(tmp_path / "o"), progress=False)
    # the command line (invoke prepare-data) says the same in one line, exit code 2
    from pithtrain.data import main
    assert main(["--inputs", str(bad), "--tokenizer", str(tokenizer_dir), "--out", str(tmp_path / "o")]) == 2
    assert main(["--inputs", str(bad), "--tokenizer", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "error: " in err and "no 'text' field" in err and "no tokenizer.json" in err and "Traceback" not in err


def test_truncated_shard_is_detected(tmp_path, tokenizer_dir):
    src = tmp_path / "a.txt"
    src.write_text("hello world " * 100)
    out = tmp_path / "s"
    prepare_data([str(src)], str(tokenizer_dir), str(out), progress=False)
    shard = next(out.glob("*.bin"))
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(ConfigError, match="truncated"):
        shard_tokens(out)


@pytest.mark.quick
def test_a_run_on_a_small_vocabulary_trains_and_exports_with_its_checkpoints_tokenizer(
        tmp_path, tiny_overrides, tokenizer_dir, capsys):
    """Shards of a 128-token vocabulary and model.vocab_size 128 (below the stdlib data's 258):
    the run trains, and export reads the checkpoint without the training data's checks (the
    shards are gone by then, as on another machine). The tokenizer comes from the checkpoint; a
    shards checkpoint without one is an error naming the file (it was exit 0 and no tokenizer),
    until the file is put where the error says; the stdlib bytes have none, and export says so."""
    import shutil

    from pithtrain.checkpoint.export import main as export_main
    from pithtrain.train import main as train_main
    rng = np.random.default_rng(1)
    shards = write_shards(tmp_path / "s", [rng.integers(0, 128, 20_000)], vocab_size=128)
    run = [o for o in tiny_overrides if not o.startswith(("train.steps", "data."))]
    assert train_main(run + ["train.steps=2", "data.source=shards", f"data.path={shards}",
                             "model.vocab_size=128"]) == 0
    shutil.rmtree(shards)
    capsys.readouterr()
    assert export_main(["--ckpt", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(r"error: \S+/step_2/tokenizer.json: missing \(saved before checkpoints carried the run's "
                        r"tokenizer\): copy the one beside the run's shards \(\S+/s\) there\n", err), err
    assert not (tmp_path / "hf").exists()  # refused before anything was written
    shutil.copyfile(tokenizer_dir / "tokenizer.json", tmp_path / "run/checkpoints/step_2/tokenizer.json")
    assert export_main(["--ckpt", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["vocab_size"] == 128
    assert (tmp_path / "hf/tokenizer.json").read_bytes() == (tokenizer_dir / "tokenizer.json").read_bytes()
    tok_cfg = json.loads((tmp_path / "hf/tokenizer_config.json").read_text())
    assert tok_cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    # the stdlib bytes: no tokenizer, said so
    assert train_main([*run, "train.steps=1", f"log.run_dir={tmp_path / 'run3'}"]) == 0
    capsys.readouterr()
    assert export_main(["--ckpt", str(tmp_path / "run3"), "--out", str(tmp_path / "hf3")]) == 0
    assert "export: no tokenizer: the run trained on stdlib bytes" in capsys.readouterr().out
    assert not (tmp_path / "hf3/tokenizer.json").exists()
    # the special ids travel in config.json and generation_config.json (generate stops at EOS): the bytes'
    special = {"bos_token_id": 256, "eos_token_id": 257, "pad_token_id": 257}
    assert json.loads((tmp_path / "hf3/generation_config.json").read_text()) == special
    assert special.items() <= json.loads((tmp_path / "hf3/config.json").read_text()).items()


@pytest.mark.quick
def test_special_token_ids_of_an_export_come_from_the_checkpoints_tokenizer(tmp_path):
    """A tokenizer whose post-processor puts <s> first and declares <pad>: BOS, the run's EOS and pad."""
    from pithtrain.checkpoint.export import special_token_ids

    ckpt = _templated_tokenizer(tmp_path / "ckpt", "<s> $A </s>", {"pad_token": "<pad>"})
    (ckpt / "trainer.json").write_text(json.dumps({"data": {"eos_id": 1}}))
    shards = {"data": {"source": "shards"}}
    assert special_token_ids(ckpt, shards) == {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 3}
    (ckpt / "tokenizer_config.json").unlink()  # no pad declared: EOS pads; no BOS added: none
    _templated_tokenizer(tmp_path / "t2", "$A </s>")
    (ckpt / "tokenizer.json").write_bytes((tmp_path / "t2/tokenizer.json").read_bytes())
    assert special_token_ids(ckpt, shards) == {"eos_token_id": 1, "pad_token_id": 1}


def _shard_bytes(d):
    return {p.name: p.read_bytes() for p in sorted(d.glob("*.bin"))}


def test_prepare_data_from_parquet_and_a_datasets_directory_in_parallel(tmp_path, tokenizer_dir):
    """A parquet file and a `datasets` save_to_disk directory (a DatasetDict: the split is chosen)
    tokenize through 2 worker processes into the same shards as one process, and the same ids as
    the tokenizer gives document by document."""
    datasets = pytest.importorskip("datasets")
    from tokenizers import Tokenizer

    texts = [f"hello world {i} " * (i % 7 + 1) for i in range(700)]
    pq = tmp_path / "docs.parquet"
    datasets.Dataset.from_dict({"body": texts[:400], "n": list(range(400))}).to_parquet(str(pq))
    ds_dir = tmp_path / "ds"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"body": texts[400:]}),
                          "test": datasets.Dataset.from_dict({"body": ["unused"]})}).save_to_disk(str(ds_dir))
    runs = {}
    for n in (1, 2):
        out = tmp_path / f"out{n}"
        meta = prepare_data([str(pq), str(ds_dir)], str(tokenizer_dir), str(out), text_key="body",
                            shard_tokens_max=2000, progress=False, num_proc=n, batch_docs=64)
        runs[n] = (meta, _shard_bytes(out))
    assert runs[1] == runs[2]
    meta = runs[1][0]
    assert meta["documents"] == 700 and len(meta["files"]) > 2
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    want = np.concatenate([tok.encode(t).ids + [eos] for t in texts])
    assert np.array_equal(np.asarray(shard_tokens(tmp_path / "out2")[:]), want)
    assert meta["eos_id"] == eos and meta["vocab_size"] == tok.get_vocab_size()
    assert (tmp_path / "out1" / "tokenizer.json").is_file()  # the shards carry their tokenizer
    with pytest.raises(ValueError, match=r"docs.parquet: no 'text' column \(columns: body, n; use --text-key\)"):
        prepare_data([str(pq)], str(tokenizer_dir), str(tmp_path / "o"), progress=False)
    with pytest.raises(ValueError, match=r"ds: no split 'valid' \(splits: train, test; use --split\)"):
        prepare_data([str(ds_dir)], str(tokenizer_dir), str(tmp_path / "o"), text_key="body", split="valid",
                     progress=False)


def test_tokenizer_fingerprint_ignores_formatting(tmp_path, tokenizer_dir):
    from pithtrain.data import tokenizer_fingerprint

    reformatted = tmp_path / "re" / "tokenizer.json"
    reformatted.parent.mkdir()
    reformatted.write_text(json.dumps(json.loads((tokenizer_dir / "tokenizer.json").read_text()), indent=7))
    assert tokenizer_fingerprint(reformatted) == tokenizer_fingerprint(tokenizer_dir)
    other = json.loads(reformatted.read_text())
    other["added_tokens"][0]["content"] = "<other>"
    reformatted.write_text(json.dumps(other))
    assert tokenizer_fingerprint(reformatted) != tokenizer_fingerprint(tokenizer_dir)


def _other_tokenizer(tmp_path, name="tok2"):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(["a different corpus entirely"] * 50,
                            trainers.BpeTrainer(vocab_size=280, special_tokens=["<unk>", "<|endoftext|>"]))
    d = tmp_path / name
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    return d


def test_mismatched_tokenizer_vocab_or_init_from_is_one_line_before_anything_is_built(
        tmp_path, tokenizer_dir, tiny_overrides, capsys):
    """The shards' tokenizer (meta.json tokenizer_sha256) must be train.init_from's, the stdlib bytes
    never feed a checkpoint that has a tokenizer, and the vocabulary must fit the model: each is a
    one-line error (exit 2) from the config, before any model or run directory exists."""
    from pithtrain.models.qwen3_moe import Qwen3MoeConfig
    from pithtrain.train import main

    src = tmp_path / "a.txt"
    src.write_text("hello world " * 300)
    shards = tmp_path / "shards"
    prepare_data([str(src)], str(tokenizer_dir), str(shards), progress=False)
    other = tmp_path / "other"
    prepare_data([str(src)], str(_other_tokenizer(tmp_path)), str(other), progress=False)

    def hub(name, tok_dir, vocab=320):
        d = tmp_path / name
        d.mkdir()
        small = dict(vocab_size=vocab, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                     moe_intermediate_size=32, num_experts=4, top_k=2, max_position_embeddings=256)
        (d / "config.json").write_text(json.dumps(Qwen3MoeConfig(**small).to_hf()))
        if tok_dir is not None:
            (d / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
        return d

    same, differs = hub("same", tokenizer_dir), hub("differs", _other_tokenizer(tmp_path, "tok3"))
    small_vocab = hub("small", tokenizer_dir, vocab=20)
    run = [o for o in tiny_overrides if not o.startswith(("data.", "model."))]
    shard = ["data.source=shards", f"data.path={shards}"]
    cases = [
        ([f"train.init_from={differs}", *shard], r"data.path: .*shards' was tokenized with .*tok.*, not with "
                                                 r".*differs/tokenizer.json \(meta.json tokenizer_sha256 differs\)"),
        ([f"train.init_from={same}"], r"data.source: 'stdlib' feeds byte ids to train.init_from's model, whose "
                                      r"tokenizer is .*same/tokenizer.json"),
        ([f"train.init_from={small_vocab}", *shard], r"train.init_from's config.json vocab_size: 20 is smaller "
                                                     r"than the vocabulary of the token shards"),
        ([*shard, "train.eval_every=5", f"data.val_path={other}"], r"data.val_path: .*other' was tokenized with"),
        ([*shard, "model.vocab_size=20"], r"model.vocab_size: 20 is smaller than the vocabulary"),
    ]
    for overrides, needle in cases:
        assert main(run + overrides) == 2, overrides
        out, err = capsys.readouterr()
        assert len(err.strip().splitlines()) == 1 and re.search(needle, err), (overrides, err)
        assert "building the model" not in out and not (tmp_path / "run").exists()
    cfg = load_config(None, run + [f"train.init_from={same}", *shard])  # the matching pair loads
    assert cfg.model.vocab_size == 320


# ---------------------------------------------------------------------------------------------
# No silent wrong data: every input is read as what it is, or refused in one line naming it


def test_prepare_data_reads_json_csv_compressed_files_directories_and_globs(tmp_path, tokenizer_dir):
    """JSON lines named .json, .csv, a gzipped .jsonl, a gzipped .txt (one document, as a plain
    one), a directory of .txt files (hidden files skipped) and a glob: each record is one document
    with the tokenizer's own ids (a .json file was one document of raw JSON; a directory was
    refused with `datasets`' message)."""
    pytest.importorskip("datasets")
    import gzip

    from tokenizers import Tokenizer
    (tmp_path / "a.json").write_text("\n".join(json.dumps({"text": f"hello {i}"}) for i in range(3)))
    (tmp_path / "b.csv").write_text("text,n\nworld one,1\nworld two,2\n")
    with gzip.open(tmp_path / "c.jsonl.gz", "wt") as f:
        f.write(json.dumps({"text": "this is"}) + "\n")
    with gzip.open(tmp_path / "d.txt.gz", "wt") as f:
        f.write("two lines\nof one document")
    (tmp_path / "txt" / "sub").mkdir(parents=True)
    (tmp_path / "txt" / "1.txt").write_text("pithtrain one")
    (tmp_path / "txt" / "sub" / "2.txt").write_text("pithtrain two")
    (tmp_path / "txt" / ".DS_Store").write_bytes(b"\0\1")
    inputs = [str(tmp_path / i) for i in ("a.json", "b.csv", "c.jsonl.gz", "d.txt.gz", "txt", "txt/*.txt")]
    meta = prepare_data(inputs, str(tokenizer_dir), str(tmp_path / "out"), progress=False)
    want = ["hello 0", "hello 1", "hello 2", "world one", "world two", "this is", "two lines\nof one document",
            "pithtrain one", "pithtrain two", "pithtrain one"]
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    ids = np.concatenate([tok.encode(t).ids + [meta["eos_id"]] for t in want])
    assert np.array_equal(np.asarray(shard_tokens(tmp_path / "out")[:]), ids)
    assert [i["documents"] for i in meta["inputs"]] == [3, 2, 1, 1, 2, 1] and meta["documents"] == 10
    (tmp_path / "notes.md").write_text("# a title")
    reads = (r"prepare-data reads .txt .jsonl .json .csv .parquet .arrow files \(the first four also .gz .bz2 .xz "
             r".zst\), directories and globs of them")
    for bad in (tmp_path / "notes.md", tmp_path / "txt"):  # alone, and in a directory
        (tmp_path / "txt" / "notes.md").write_text("# a title")
        with pytest.raises(ValueError, match=rf"notes.md: unknown input suffix '.md'; {reads}"):
            prepare_data([str(bad)], str(tokenizer_dir), str(tmp_path / "o"), progress=False)
    with pytest.raises(FileNotFoundError, match=r"nothing/\*.txt: no file matches"):
        prepare_data([str(tmp_path / "nothing/*.txt")], str(tokenizer_dir), str(tmp_path / "o"), progress=False)
    (tmp_path / "e.json").write_text('{"body": "no text"}\n')
    with pytest.raises(ValueError, match=r"e.json: no 'text' column \(columns: body; use --text-key\)"):
        prepare_data([str(tmp_path / "e.json")], str(tokenizer_dir), str(tmp_path / "o"), progress=False)


def test_prepare_data_mixes_inputs_by_weight_and_ends_with_a_summary(tmp_path, tokenizer_dir, capsys):
    """--weights 2,0.5: the first input's documents twice (in two passes: copies never side by
    side), every other one of the second's; the summary names documents, tokens, shards, the
    vocabulary, EOS and each input's share."""
    from tokenizers import Tokenizer

    from pithtrain.data import main
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("\n".join(json.dumps({"text": f"hello {i}"}) for i in range(4)))
    b.write_text("\n".join(json.dumps({"text": f"world {i}"}) for i in range(4)))
    assert main(["--inputs", f"{a},{b}", "--tokenizer", str(tokenizer_dir), "--out", str(tmp_path / "o"),
                 "--weights", "2,0.5", "--num-proc", "1"]) == 0
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    want = [f"hello {i}" for i in range(4)] * 2 + ["world 1", "world 3"]
    eos = tok.token_to_id("<|endoftext|>")
    ids = [i for t in want for i in tok.encode(t).ids + [eos]]
    assert np.asarray(shard_tokens(tmp_path / "o")[:]).tolist() == ids
    n_a = sum(len(tok.encode(t).ids) + 1 for t in want[:8])
    out = capsys.readouterr().out.splitlines()
    assert out == [f"prepare-data: 10 documents, {len(ids)} tokens in 1 shard(s) (uint16) -> {tmp_path / 'o'}; "
                   f"vocabulary {tok.get_vocab_size()}, EOS '<|endoftext|>' (id {eos}), no BOS; "
                   f"tokenizer {tokenizer_dir} "
                   f"(sha256 {json.loads((tmp_path / 'o/meta.json').read_text())['tokenizer_sha256'][:12]})",
                   f"  {a}: 8 documents (x2), {n_a} tokens ({100 * n_a / len(ids):.1f}%)",
                   f"  {b}: 2 documents (x0.5), {len(ids) - n_a} tokens ({100 - 100 * n_a / len(ids):.1f}%)"]
    with pytest.raises(ValueError, match=r"--weights: 2 numbers > 0 for the 2 inputs, got \[1.0\]"):
        prepare_data([str(a), str(b)], str(tokenizer_dir), str(tmp_path / "o"), weights=[1.0], progress=False)


def test_a_tokenizer_without_a_known_end_of_text_token_needs_eos(tmp_path, capsys):
    """Documents were joined with no separator (eos_id: null), silently; now the run names the
    tokenizer's special tokens and --eos picks one."""
    from tokenizers import Tokenizer, models, trainers

    from pithtrain.data import main
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.train_from_iterator(["abc abd"] * 20, trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>", "<sep>"]))
    d = tmp_path / "tok"
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    src = tmp_path / "a.jsonl"
    src.write_text('{"text": "abc"}\n{"text": "abd"}\n')
    with pytest.raises(ValueError, match=r"tok: no end-of-text token among </s>, <\|endoftext\|>, <eos>, "
                                         r"<\|end_of_text\|>; pass the one that ends a document with --eos "
                                         r"\(its special tokens: <unk>, <sep>\)"):
        prepare_data([str(src)], str(d), str(tmp_path / "o"), progress=False)
    meta = prepare_data([str(src)], str(d), str(tmp_path / "o"), progress=False, eos="<sep>")
    sep = tok.token_to_id("<sep>")
    assert meta["eos_id"] == sep and meta["eos"] == "<sep>"
    want = tok.encode("abc").ids + [sep] + tok.encode("abd").ids + [sep]
    assert np.asarray(shard_tokens(tmp_path / "o")[:]).tolist() == want
    assert main(["--inputs", str(src), "--tokenizer", str(d), "--out", str(tmp_path / "o2"), "--eos", "<nope>"]) == 2
    assert capsys.readouterr().err.strip().endswith("tok: --eos '<nope>' is not one of its tokens; pass the one that "
                                                    "ends a document with --eos (its special tokens: <unk>, <sep>)")


@pytest.mark.parametrize("name, missing", [("./tok", "tok"), ("data/tok", "data/tok"), ("a/b/tokenizer.json", "a"),
                                           ("tok.json", "tok.json"), ("~/no/such/tok", "~/no"), ("tokk/", "tokk"),
                                           ("tokk", "tokk")])
def test_a_tokenizer_name_that_looks_like_a_path_never_goes_to_the_hub(tmp_path, monkeypatch, name, missing):
    """A mistyped local path was taken for a hub id (25 s of retries, then "check your connection"):
    one line now names the part of the path that is missing. ORG/NAME still goes to the hub."""
    import tokenizers

    from pithtrain.data import _iter_source, load_tokenizer
    asked = []

    class Hub:
        @staticmethod
        def from_pretrained(name):
            asked.append(name)
            return "from the hub"

    monkeypatch.setattr(tokenizers, "Tokenizer", Hub)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    with pytest.raises(FileNotFoundError) as e:
        load_tokenizer(name)
    home = str(Path("~").expanduser())
    hint = "; a hub id is ORG/NAME" if name == "tokk" else ""  # a bare name: the hub's are ORG/NAME
    assert str(e.value).replace(home, "~") == f"{name}: not found ({missing} does not exist{hint})" and asked == []
    assert load_tokenizer("org/name") == "from the hub" and asked == ["org/name"]
    with pytest.raises(FileNotFoundError, match=r"data/corpus: not found \(data/corpus does not exist\)"):
        _iter_source("data/corpus", "text", "train")  # was streamed from the hub as a dataset id


def _templated_tokenizer(d: Path, single: str, config: dict | None = None) -> Path:
    """A byte-level BPE with <s>, </s> and <|endoftext|> whose post-processor is the template `single`
    (e.g. "<s> $A </s>": what many hub tokenizers add to every text), saved in directory d."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["hello world 0 one two"] * 20, trainers.BpeTrainer(
        vocab_size=280, special_tokens=["<s>", "</s>", "<|endoftext|>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if single:
        tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=[("<s>", 0), ("</s>", 1)])
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    if config:
        (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


@pytest.mark.quick
@pytest.mark.parametrize("single, config, bos, eos", [
    ("<s> $A </s>", None, "<s>", "</s>"),  # was <s> text </s></s>
    ("$A </s>", None, None, "</s>"),  # was text </s></s>
    ("<s> $A", {"eos_token": {"content": "<|endoftext|>"}}, "<s>", "<|endoftext|>"),  # the directory names its EOS
    ("", None, None, "</s>")])  # no post-processor: the first of EOS_NAMES it has
def test_a_document_ends_with_one_eos_and_keeps_the_tokenizers_bos(tmp_path, single, config, bos, eos, capsys):
    """prepare-data reads the post-processor: its BOS stays (inference's tokenizer(text) adds it too),
    and its EOS is the separator, never doubled; meta.json and the summary say which."""
    from tokenizers import Tokenizer

    from pithtrain.data import main
    tok_dir = _templated_tokenizer(tmp_path / "tok", single, config)
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    texts = ["hello world", "one two 0", "hello"]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in texts))
    assert main(["--inputs", str(tmp_path / "a.jsonl"), "--tokenizer", str(tok_dir), "--out", str(tmp_path / "o"),
                 "--num-proc", "1"]) == 0
    meta = json.loads((tmp_path / "o/meta.json").read_text())
    ids = np.asarray(shard_tokens(tmp_path / "o")[:]).tolist()
    b, e = tok.token_to_id(bos) if bos else None, tok.token_to_id(eos)
    want = [i for t in texts for i in [b] * (b is not None) + tok.encode(t, add_special_tokens=False).ids + [e]]
    assert ids == want and ids.count(e) == len(texts)
    assert (meta["bos_id"], meta["bos"], meta["eos_id"], meta["eos"]) == (b, bos, e, eos)
    said = f"BOS {bos!r} (id {b}, its post-processor's)" if bos else "no BOS"
    assert f"EOS {eos!r} (id {e}), {said}; tokenizer" in capsys.readouterr().out


def test_data_path_with_the_stdlib_source_is_refused():
    """data.path without data.source=shards trained on the interpreter's bytes, silently."""
    with pytest.raises(ConfigError, match=r"command-line override 'data.path=data/train': data.path: 'data/train' "
                                          r"is given but data.source is 'stdlib' \(the interpreter's own bytes\); "
                                          r"set data.source=shards to train on it"):
        load_config(None, ["data.path=data/train"])


def test_vocab_size_auto_is_the_datas_vocabulary_padded_and_said(tmp_path):
    d = write_shards(tmp_path / "s", [np.arange(200)], vocab_size=300)
    cfg = load_config(None, ["data.source=shards", f"data.path={d}", "model.vocab_size=auto"])
    assert cfg.model.vocab_size == 320
    assert cfg.notes == [f"model.vocab_size: auto -> 320 ({d}/meta.json vocab_size 300, padded to a multiple of 64)"]
    assert load_config(None, ["model.vocab_size=auto"]).model.vocab_size == 320  # the stdlib bytes: 258
    d = write_shards(tmp_path / "t", [np.arange(200)], vocab_size=256)
    assert load_config(None, ["data.source=shards", f"data.path={d}", "model.vocab_size=auto"]).model.vocab_size == 256


def test_resuming_onto_shards_of_another_tokenizer_is_refused_unless_the_recipe_allows_it(
        tmp_path, tokenizer_dir, tiny_overrides, capsys):
    """It printed only "recipe differs" and trained on (loss 0.91 -> 6.33): the checkpoint records
    its tokenizer's fingerprint (trainer.json) and resume compares it with the shards'."""
    from pithtrain.train import main

    src = tmp_path / "a.txt"
    src.write_text("hello world, this is pithtrain " * 100)
    prepare_data([str(src)], str(tokenizer_dir), str(tmp_path / "a"), progress=False)
    prepare_data([str(src)], str(_other_tokenizer(tmp_path)), str(tmp_path / "b"), progress=False)
    run = [o for o in tiny_overrides if not o.startswith(("train.steps", "data."))] + ["data.source=shards"]
    assert main(run + ["train.steps=1", f"data.path={tmp_path / 'a'}"]) == 0
    capsys.readouterr()
    assert main(run + ["train.steps=2", f"data.path={tmp_path / 'b'}"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and re.search(
        r"step_1: trained on ids of tokenizer \S+/tok \(sha256 [0-9a-f]{12}\); the data now is \S+/b, of \S+/tok2 "
        r"\(sha256 [0-9a-f]{12}\): its ids mean other tokens. To train on this data, start fresh with --no-resume "
        r".* or choose another log.run_dir; or resume onto data of the checkpoint's tokenizer "
        r"\(data.allow_tokenizer_change=true continues on these ids anyway\)", err), err
    assert main(run + ["train.steps=2", f"data.path={tmp_path / 'b'}", "data.allow_tokenizer_change=true"]) == 0
    out = capsys.readouterr().out
    assert "checkpoint: tokenizer changed from" in out and "resumed from" in out and "step      2" in out
