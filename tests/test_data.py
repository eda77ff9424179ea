import json

import numpy as np
import pytest
import torch

from pithtrain.data import BOS, DATA_VOCAB_SIZE, EOS, TokenBatches, prepare_data, shard_tokens, stdlib_tokens


def test_stdlib_tokens_are_bytes_with_document_markers():
    t = stdlib_tokens(200_000)
    assert len(t) >= 200_000 and t.max() < DATA_VOCAB_SIZE
    assert t[0] == BOS and (t == EOS).sum() >= 1
    # the bytes between the first BOS/EOS are a real Python source file
    end = int(np.argmax(t == EOS))
    text = bytes(t[1:end].astype(np.uint8)).decode("utf-8", errors="replace")
    assert "import" in text or "def " in text or '"""' in text


def test_batches_are_deterministic_shifted_and_layout_independent():
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


def test_rows_partition_the_global_batch():
    from pithtrain.data import rows

    seen = []
    for micro in range(3):
        for r in range(2):
            s = rows(micro, r, 2, 4)
            seen += list(range(s.start, s.stop))
    assert sorted(seen) == list(range(24))


def test_too_little_data_is_an_error():
    with pytest.raises(ValueError, match="too few"):
        TokenBatches(np.zeros(50, dtype=np.uint16), seq_len=64, global_batch=2, seed=0)


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
    toks = shard_tokens(out)
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    first = [int(i) for i in toks[: list(toks).index(eos)]]
    assert first == tok.encode("hello world 0").ids
    assert sum(f["tokens"] for f in meta["files"]) == len(toks)


def test_prepare_data_errors_name_the_file(tmp_path, tokenizer_dir):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: no 'text' field"):
        prepare_data([str(bad)], str(tokenizer_dir), str(tmp_path / "o"), progress=False)
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        prepare_data([str(tmp_path / "missing.txt")], str(tokenizer_dir), str(tmp_path / "o"), progress=False)


def test_truncated_shard_is_detected(tmp_path, tokenizer_dir):
    src = tmp_path / "a.txt"
    src.write_text("hello world " * 100)
    out = tmp_path / "s"
    prepare_data([str(src)], str(tokenizer_dir), str(out), progress=False)
    shard = next(out.glob("*.bin"))
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(RuntimeError, match="truncated"):
        shard_tokens(out)
