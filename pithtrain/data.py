"""Token data: the embedded default (the interpreter's own standard-library source, byte-level) and
memory-mapped token shards written by `prepare_data` (`invoke prepare-data`).

Batches are a pure function of (seed, step, micro-batch index): the global batch of a step is the
same whatever the parallel layout, each data-parallel rank takes its rows, and resuming needs only
the step number (the data-loader position saved in checkpoints).
"""

from __future__ import annotations

import json
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch

from pithtrain.config import ConfigError

BOS, EOS = 256, 257
DATA_VOCAB_SIZE = 258  # 256 bytes + BOS + EOS


# ---------------------------------------------------------------------------------------------
# Sources: each yields one flat token array (documents joined with BOS ... EOS)


def stdlib_tokens(max_bytes: int) -> np.ndarray:
    """Byte-level tokens of the running interpreter's standard-library .py files, in sorted order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts)
    if not files:
        raise RuntimeError(f"no standard-library sources found under {root}")
    chunks, total = [], 0
    for p in files:
        data = p.read_bytes()
        chunks.append(np.concatenate([[BOS], np.frombuffer(data, dtype=np.uint8), [EOS]]).astype(np.uint16))
        total += len(data) + 2
        if total >= max_bytes:
            break
    return np.concatenate(chunks)


def read_meta(path: str | Path) -> dict:
    """A prepared directory's meta.json, checked (dtype, vocab_size, each listed shard present at its
    full size) so that a bad directory is a one-line ConfigError naming the file, not a traceback."""
    path = Path(path)
    meta_file = path / "meta.json"

    def bad(msg):
        raise ConfigError(f"{meta_file}: {msg}; re-create the directory with `invoke prepare-data`")

    try:
        meta = json.loads(meta_file.read_text())
    except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
        bad(f"not valid JSON ({e})")
    if not isinstance(meta, dict):
        bad(f"expected a JSON object, got {type(meta).__name__}")
    if meta.get("dtype") not in ("uint16", "uint32"):
        bad(f"dtype must be 'uint16' or 'uint32', got {meta.get('dtype')!r}")
    if "vocab_size" not in meta:
        bad("no vocab_size (the tokenizer's vocabulary size), so the token ids cannot be checked "
            "against model.vocab_size")
    if not _is_count(meta["vocab_size"]) or meta["vocab_size"] < 1:
        bad(f"vocab_size must be a positive integer, got {meta['vocab_size']!r}")
    files = meta.get("files")
    if not isinstance(files, list) or not files or not all(
            isinstance(f, dict) and isinstance(f.get("name"), str) and _is_count(f.get("tokens")) for f in files):
        bad('files must be a non-empty list of {"name": shard file, "tokens": count}')
    if meta["vocab_size"] > np.iinfo(meta["dtype"]).max + 1:
        bad(f"dtype {meta['dtype']} cannot hold the ids of vocab_size {meta['vocab_size']}")
    itemsize = np.dtype(meta["dtype"]).itemsize
    for f in files:
        if f["name"] in ("", ".", "..") or Path(f["name"]).name != f["name"] or "\\" in f["name"]:
            bad(f"shard name {f['name']!r} is not a plain file name in {path} (no directories or '..')")
        fp = path / f["name"]
        if not fp.is_file():
            raise ConfigError(f"{fp}: shard listed in {meta_file} is missing")
        size, expected = fp.stat().st_size, f["tokens"] * itemsize
        if size != expected:
            raise ConfigError(f"{fp}: truncated or wrong-size shard: {size} bytes, {meta_file} says "
                              f"{f['tokens']} tokens ({expected} bytes)")
    return meta


def check_token_ids(path: str | Path, meta: dict, every_s: float = 10.0):
    """Every id in the shards is < meta's vocab_size, and uint16 data is not uint32 data in
    disguise (read as uint16, little-endian uint32 ids below 65536 leave every odd element 0).
    Reads all tokens once (memory-mapped, 64M at a time), with a progress line every `every_s`."""
    path, vocab = Path(path), meta["vocab_size"]
    total = sum(f["tokens"] for f in meta["files"])
    t0 = last = time.monotonic()
    done, chunk = 0, 1 << 26
    for f in meta["files"]:
        if not f["tokens"]:
            continue
        a = np.memmap(path / f["name"], dtype=meta["dtype"], mode="r")
        head = a[:1 << 20]
        if meta["dtype"] == "uint16" and len(head) >= 64 and not head[1::2].any() and head[0::2].any():
            raise ConfigError(f"{path / f['name']}: every second uint16 is 0: this looks like uint32 data "
                              f"declared uint16 in {path / 'meta.json'}; re-create it with `invoke prepare-data`")
        for start in range(0, len(a), chunk):
            part = a[start:start + chunk]
            if int(part.max()) >= vocab:
                at = start + int(np.argmax(part >= vocab))
                raise ConfigError(f"{path / f['name']}: token id {int(a[at])} at position {at} is outside "
                                  f"the vocabulary (vocab_size {vocab} in {path / 'meta.json'})")
            done += len(part)
            if time.monotonic() - last >= every_s:
                last = time.monotonic()
                print(f"data: checking token ids: {done / 1e6:.0f}M of {total / 1e6:.0f}M "
                      f"({last - t0:.0f} s)", flush=True)


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def shard_tokens(path: str | Path) -> ShardedTokens:
    """All shards of a prepared directory, memory-mapped and joined lazily."""
    meta = read_meta(path)
    return ShardedTokens([np.memmap(Path(path) / f["name"], dtype=meta["dtype"], mode="r")
                          for f in meta["files"] if f["tokens"]], meta["dtype"])  # memmap can't map empty files


class ShardedTokens:
    """Memory-mapped shards read as one token sequence. A slice reads only the shards it covers, so
    a dataset larger than RAM stays on disk; one that spans a boundary copies from both sides."""

    def __init__(self, shards: list[np.ndarray], dtype):
        self.shards, self.dtype = shards, np.dtype(dtype)
        self.starts = np.cumsum([0] + [len(a) for a in shards])  # shard i holds [starts[i], starts[i+1])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, key):
        r = range(len(self))[key]  # Python's own index rules: negatives, bounds, slice clipping
        if isinstance(r, int):
            return self._read(r, r + 1)[0]
        if r.step != 1:
            raise IndexError("ShardedTokens supports contiguous slices only")
        return self._read(r.start, r.stop)

    def _read(self, start: int, stop: int) -> np.ndarray:
        if stop <= start:
            return np.empty(0, dtype=self.dtype)
        first = int(np.searchsorted(self.starts, start, side="right")) - 1
        last = int(np.searchsorted(self.starts, stop, side="left")) - 1  # the shard holding stop - 1
        parts = [self.shards[k][max(start - self.starts[k], 0):stop - self.starts[k]]
                 for k in range(first, last + 1)]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


# ---------------------------------------------------------------------------------------------
# Batches


class TokenBatches:
    """Random windows of seq_len + 1 tokens. `batch(step)` returns the step's global batch
    (inputs, labels), each (global_batch, seq_len) int64; callers slice their micro-batch rows
    (`rows`). The last 1% of tokens is held out for validation. `source` names the data in errors."""

    def __init__(self, tokens: np.ndarray | ShardedTokens, seq_len: int, global_batch: int, seed: int,
                 source: str = "the token data"):
        n_val = max(seq_len + 1, len(tokens) // 100)
        if len(tokens) - n_val <= seq_len + 1:  # i.e. fewer than 2 * seq_len + 3 tokens
            raise ConfigError(f"{source}: only {len(tokens)} tokens, too few for train.seq_len {seq_len} "
                              f"(one window each for training and validation needs >= {2 * seq_len + 3})")
        self.tokens, self.seq_len, self.global_batch, self.seed = tokens, seq_len, global_batch, seed
        self.n_train = len(tokens) - n_val

    def _windows(self, starts):
        rows = np.stack([np.asarray(self.tokens[s:s + self.seq_len + 1], dtype=np.int64) for s in starts])
        t = torch.from_numpy(rows)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()

    def batch(self, step: int):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, self.n_train - self.seq_len - 1, (self.global_batch,), generator=g)
        return self._windows(starts.tolist())

    def val_batch(self, i: int = 0):
        span = len(self.tokens) - self.n_train - self.seq_len - 1
        g = torch.Generator().manual_seed(i)
        starts = self.n_train + torch.randint(0, max(span, 1), (self.global_batch,), generator=g)
        return self._windows(starts.tolist())


def rows(micro: int, dp_rank: int, dp_size: int, micro_batch_size: int) -> slice:
    """The rows of the global batch that micro-batch `micro` of data-parallel rank `dp_rank` owns."""
    start = (micro * dp_size + dp_rank) * micro_batch_size
    return slice(start, start + micro_batch_size)


def build_batches(data_cfg, seq_len: int, global_batch: int, seed: int) -> TokenBatches:
    if data_cfg.source == "stdlib":
        tokens, source = stdlib_tokens(data_cfg.max_bytes), f"data.max_bytes {data_cfg.max_bytes} (stdlib source)"
    else:
        tokens, source = shard_tokens(data_cfg.path), f"data.path {data_cfg.path!r}"
    return TokenBatches(tokens, seq_len, global_batch, seed, source)


# ---------------------------------------------------------------------------------------------
# prepare-data: text / JSONL -> uint16/uint32 shards + meta.json


def prepare_data(inputs: list[str], tokenizer_dir: str, out_dir: str, text_key: str = "text",
                 shard_tokens_max: int = 100_000_000, progress=True) -> dict:
    """Tokenize .txt (one document per file) or .jsonl (one document per line, field `text_key`)
    files with a Hugging Face tokenizer from a local directory (its tokenizer.json)."""
    from tokenizers import Tokenizer  # optional dependency: pip install 'pithtrain[data]'

    tok_file = Path(tokenizer_dir) / "tokenizer.json"
    if not tok_file.is_file():
        raise FileNotFoundError(f"{tok_file}: no tokenizer.json in the tokenizer directory")
    tokenizer = Tokenizer.from_file(str(tok_file))
    vocab = tokenizer.get_vocab_size()
    dtype = np.uint16 if vocab <= 65535 else np.uint32
    eos = _special_id(tokenizer, ("</s>", "<|endoftext|>", "<eos>"), fallback=None)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [Path(p) for p in inputs]
    for p in paths:
        if not p.is_file():
            raise FileNotFoundError(f"{p}: input file does not exist")
    total_bytes = sum(p.stat().st_size for p in paths)
    files, buf, done_bytes, n_docs, t0 = [], [], 0, 0, time.time()
    buf_tokens = 0  # len of buf's arrays together, kept as they arrive (summing per document is quadratic)

    def flush():
        nonlocal buf_tokens
        if not buf:
            return
        arr = np.concatenate(buf).astype(dtype)
        name = f"shard_{len(files):05d}.bin"
        tmp = out / (name + ".tmp")
        arr.tofile(tmp)
        tmp.rename(out / name)
        files.append({"name": name, "tokens": int(len(arr))})
        buf.clear()
        buf_tokens = 0

    for p in paths:
        docs = _iter_docs(p, text_key)
        for text, nbytes in docs:
            ids = tokenizer.encode(text).ids + ([eos] if eos is not None else [])
            buf.append(np.asarray(ids, dtype=np.int64))
            buf_tokens += len(ids)
            n_docs += 1
            done_bytes += nbytes
            if buf_tokens >= shard_tokens_max:
                flush()
            if progress and n_docs % 200 == 0:
                _progress(done_bytes, total_bytes, t0)
    flush()
    if progress:
        _progress(total_bytes, total_bytes, t0)
        print(file=sys.stderr)
    if not files:
        raise ValueError("no documents found in the inputs")
    meta = {"dtype": np.dtype(dtype).name, "vocab_size": vocab, "tokenizer": str(tokenizer_dir),
            "documents": n_docs, "files": files}
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    return meta


def _iter_docs(p: Path, text_key: str):
    if p.suffix == ".jsonl":
        with p.open("rb") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{p}:{n}: not valid JSON ({e.msg})") from None
                if text_key not in rec:
                    raise ValueError(f"{p}:{n}: no {text_key!r} field (use --text-key)")
                yield rec[text_key], len(line)
    else:
        data = p.read_bytes()
        yield data.decode("utf-8", errors="replace"), len(data)


def _special_id(tokenizer, names, fallback):
    for n in names:
        i = tokenizer.token_to_id(n)
        if i is not None:
            return i
    return fallback


def _progress(done, total, t0):
    frac = done / max(total, 1)
    bar = "#" * int(30 * frac)
    rate = done / max(time.time() - t0, 1e-9) / 1e6
    print(f"\rprepare-data [{bar:<30}] {100 * frac:5.1f}%  {rate:.1f} MB/s", end="", file=sys.stderr)


# ---------------------------------------------------------------------------------------------
# Entry point (`invoke prepare-data` runs this)


def main(argv: list[str] | None = None) -> int:
    """python -m pithtrain.data --inputs a.jsonl,b.txt --tokenizer DIR --out DIR [--text-key text]"""
    import argparse
    p = argparse.ArgumentParser(prog="python -m pithtrain.data", description="Tokenize text files into "
                                "token shards (data.source: shards, data.path: OUT).")
    p.add_argument("--inputs", required=True, help="comma-separated .txt / .jsonl files")
    p.add_argument("--tokenizer", required=True, help="directory holding a Hugging Face tokenizer.json")
    p.add_argument("--out", required=True, help="output directory for the shards and meta.json")
    p.add_argument("--text-key", default="text", help="the text field of .jsonl records")
    args = p.parse_args(argv)
    try:
        prepare_data(args.inputs.split(","), tokenizer_dir=args.tokenizer, out_dir=args.out,
                     text_key=args.text_key)
    except (OSError, ValueError) as e:  # a missing file, a record without the text field
        print(f"\nerror: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
