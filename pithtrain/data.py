"""Token data: the embedded default (the interpreter's own standard-library source, byte-level) and
memory-mapped token shards written by `prepare_data` (`invoke prepare-data`).

Batches are a pure function of (seed, step, micro-batch index): the global batch of a step is the
same whatever the parallel layout, each data-parallel rank takes its rows, and resuming needs only
the step number (the data-loader position saved in checkpoints). An epoch is one pass over the
windows of the data, in a seeded permutation (`TokenBatches`, data.sampler).
"""

from __future__ import annotations

import functools
import glob
import hashlib
import itertools
import json
import math
import os
import shutil
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch

from pithtrain import ConfigError

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
    chunks = []
    for p in files:
        chunks.append(np.concatenate([[BOS], np.frombuffer(p.read_bytes(), dtype=np.uint8), [EOS]]).astype(np.uint16))
        if sum(map(len, chunks)) >= max_bytes:
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
    """Windows of seq_len + 1 tokens. `batch(step)` returns the step's global batch (inputs,
    labels), each (global_batch, seq_len) int64; callers slice their micro-batch rows (`rows`).

    sampler "epochs" (data.sampler, the default): the training tokens are cut into windows once
    (`windows`), and the batches read the stream of them epoch after epoch, each epoch a
    permutation seeded by (seed, epoch): step s takes stream items s * global_batch onwards, so a
    batch is a pure function of (seed, step) and an epoch is one pass over the data, each label
    position once (prepare-data's mixture weights exactly). With `align` (document masking) a
    window holds whole documents from a document's first token, padded with separators that carry
    no loss. sampler "random": each row a window at a random start, drawn with replacement.

    Validation (`val_batch`) reads `val_tokens` when given, else the last 1% of tokens when
    `hold_out` (evaluation on), else there is none. `source` names the data in errors. eos: the
    document separator; with mask_separator, the label after each one (the next document's first
    token, predicted from the previous document) carries no loss."""

    def __init__(self, tokens: np.ndarray | ShardedTokens, seq_len: int, global_batch: int, seed: int,
                 source: str = "the token data", hold_out: bool = True, val_tokens=None,
                 eos: int | None = None, mask_separator: bool = False, sampler: str = "epochs",
                 align: bool = False):
        n_val = max(seq_len + 1, len(tokens) // 100) if hold_out and val_tokens is None else 0
        if len(tokens) - n_val <= seq_len + 1:  # i.e. fewer than 2 * seq_len + 3 tokens with a hold-out
            need = 2 * seq_len + 3 if n_val else seq_len + 2
            raise ConfigError(f"{source}: only {len(tokens)} tokens, too few for train.seq_len {seq_len} "
                              f"(one window each for training{' and validation' if n_val else ''} needs >= {need})")
        if val_tokens is not None and len(val_tokens) <= seq_len + 1:
            raise ConfigError(f"data.val_path: only {len(val_tokens)} tokens, too few for train.seq_len {seq_len}")
        self.tokens, self.seq_len, self.global_batch, self.seed = tokens, seq_len, global_batch, seed
        self.n_train = len(tokens) - n_val
        # validation windows start in [val_lo, val_hi - seq_len - 1] of val (read lazily like training's)
        self.val, self.val_lo = (val_tokens, 0) if val_tokens is not None else (tokens, self.n_train)
        self.val_hi = len(self.val) if val_tokens is not None or n_val else None
        self.eos, self.mask_separator, self.sampler = eos, mask_separator, sampler
        self.starts, self.lens = windows(tokens, self.n_train, seq_len, eos if align else None)
        # epoch -> its permutation of the windows (a batch reads at most two epochs)
        self._order = functools.lru_cache(2)(lambda e: np.random.default_rng([seed, e]).permutation(len(self.starts)))

    def epochs(self, steps: int) -> float:
        """Passes over the training data that `steps` steps make (random: tokens drawn / tokens)."""
        per_row = self.seq_len / self.n_train if self.sampler == "random" else 1 / len(self.starts)
        return steps * self.global_batch * per_row

    def _windows(self, tokens, starts, lens=None):
        """Rows of tokens[start : start + seq_len + 1]; a row of length n < seq_len + 1 (`lens`) is
        padded with separators whose labels are -100."""
        lens = np.full(len(starts), self.seq_len + 1) if lens is None else lens
        rows = np.full((len(starts), self.seq_len + 1), self.eos or 0, dtype=np.int64)
        for r, (s, n) in enumerate(zip(starts, lens)):
            rows[r, :n] = tokens[int(s):int(s) + int(n)]
        t = torch.from_numpy(rows)
        x, y = t[:, :-1].contiguous(), t[:, 1:].contiguous()
        y[torch.arange(self.seq_len) >= torch.as_tensor(lens)[:, None] - 1] = -100
        if self.mask_separator:
            y[x == self.eos] = -100
        return x, y

    def batch(self, step: int):
        if self.sampler == "random":
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
            starts = torch.randint(0, self.n_train - self.seq_len - 1, (self.global_batch,), generator=g)
            return self._windows(self.tokens, starts.tolist())
        epoch, at = np.divmod(np.arange(step * self.global_batch, (step + 1) * self.global_batch), len(self.starts))
        w = np.array([self._order(int(e))[a] for e, a in zip(epoch, at)])  # the step's windows
        return self._windows(self.tokens, self.starts[w], self.lens[w])

    def val_batch(self, i: int = 0):
        """The i-th validation batch: the same windows at every evaluation and on every layout."""
        if self.val_hi is None:
            raise RuntimeError("no validation data: build_batches(hold_out=True) holds it out")
        g = torch.Generator().manual_seed(i)
        starts = self.val_lo + torch.randint(0, self.val_hi - self.val_lo - self.seq_len, (self.global_batch,),
                                             generator=g)
        return self._windows(self.val, starts.tolist())

    def documents(self, x_BS: torch.Tensor) -> torch.Tensor:
        """Document index of each input token (for document masking): see document_ids."""
        return document_ids(x_BS, self.eos)


def windows(tokens, n: int, seq_len: int, eos: int | None = None, chunk: int = 1 << 26):
    """(starts, lengths) of an epoch's windows over tokens[:n], in order. Without `eos`: one every
    seq_len tokens, each seq_len + 1 long (its last token is the next one's first);
    every position from 1 to the last whole window's end is a label once (the last < seq_len
    tokens are in none). With `eos` (document masking): a window starts at a document's first
    token and ends at the last document end it reaches (lengths <= seq_len + 1: the rest is
    padding); a document longer than a window is cut as above, its next window starting inside it."""
    if eos is None:
        return np.arange((n - 1) // seq_len) * seq_len, np.full((n - 1) // seq_len, seq_len + 1)
    ends = np.unique(np.concatenate([np.flatnonzero(np.asarray(tokens[i:min(i + chunk, n)]) == eos) + i + 1
                                     for i in range(0, n, chunk)] + [[n]]))  # after each separator, and n
    starts, lens = [0], []
    while n - starts[-1] >= 2:  # a window of one token has no label
        pos, k = starts[-1], np.searchsorted(ends, starts[-1] + seq_len + 1, side="right")
        cut = not k or ends[k - 1] <= pos + 1  # no document ends inside: a long one, cut (as without eos)
        lens.append(seq_len + 1 if cut else ends[k - 1] - pos)
        starts.append(pos + lens[-1] - cut)
    return np.array(starts[:-1]), np.array(lens)


def document_ids(x_BS: torch.Tensor, eos: int) -> torch.Tensor:
    """(B, S) index of each token's document in its row: a document ends with its separator `eos`
    and the next one starts right after it (stdlib data: BOS ... EOS; shards: tokens ... eos)."""
    sep_BS = (x_BS == eos).long()
    return torch.cumsum(sep_BS, dim=1) - sep_BS


def rows(micro: int, dp_rank: int, dp_size: int, micro_batch_size: int) -> slice:
    """The rows of the global batch that micro-batch `micro` of data-parallel rank `dp_rank` owns."""
    start = (micro * dp_size + dp_rank) * micro_batch_size
    return slice(start, start + micro_batch_size)


def build_batches(data_cfg, seq_len: int, global_batch: int, seed: int, hold_out: bool = False) -> TokenBatches:
    """hold_out: evaluation is on (train.eval_every), so validation data is needed: data.val_path's
    shards, else the last 1% of the training tokens."""
    if data_cfg.source == "stdlib":
        tokens, source = stdlib_tokens(data_cfg.max_bytes), f"data.max_bytes {data_cfg.max_bytes} (stdlib source)"
        eos = EOS
        about = (f"stdlib bytes of {sysconfig.get_paths()['stdlib']} ({len(tokens) / 1e6:.2f}M tokens, "
                 f"{int((tokens == EOS).sum())} documents; bytes 0-255 + BOS {BOS} + EOS {EOS})")
    else:
        tokens, source = shard_tokens(data_cfg.path), f"data.path {data_cfg.path!r}"
        meta = read_meta(data_cfg.path)
        eos = meta.get("eos_id")
        about = (f"shards {data_cfg.path} ({len(tokens) / 1e6:.2f}M tokens, {meta.get('documents', '?')} documents; "
                 f"tokenizer {meta.get('tokenizer')} sha256 {str(meta.get('tokenizer_sha256'))[:12]}, "
                 f"vocabulary {meta['vocab_size']}, EOS id {eos})")
    val = shard_tokens(data_cfg.val_path) if hold_out and data_cfg.val_path else None
    batches = TokenBatches(tokens, seq_len, global_batch, seed, source, hold_out=hold_out, val_tokens=val,
                           eos=eos, mask_separator=data_cfg.mask_separator_loss, sampler=data_cfg.sampler,
                           align=data_cfg.document_mask)
    held = f"data.val_path {data_cfg.val_path}" if val is not None else "the last 1% held out" if hold_out else "none"
    sampled = (f"epochs of {len(batches.starts):,} windows{' of whole documents' * data_cfg.document_mask}, each epoch "
               "a seeded permutation" if data_cfg.sampler == "epochs" else "random windows, drawn with replacement")
    batches.about = f"{about}; validation: {held}; batches: {sampled}"  # the start-up line: what the run trains on
    return batches


def tokenizer_of(data_cfg) -> dict:
    """What the run's token ids mean (checkpoints record it; resume compares it): the shards'
    tokenizer fingerprint, EOS and vocabulary, or the stdlib bytes."""
    if data_cfg.source == "stdlib":
        return {"tokenizer": "stdlib bytes", "tokenizer_sha256": "stdlib-bytes", "eos_id": EOS, "bos_id": BOS,
                "vocab_size": DATA_VOCAB_SIZE}
    meta = read_meta(data_cfg.path)
    return {k: meta.get(k) for k in ("tokenizer", "tokenizer_sha256", "eos_id", "eos", "bos_id", "vocab_size")}


# ---------------------------------------------------------------------------------------------
# prepare-data: documents -> uint16/uint32 shards + meta.json (+ the tokenizer files used)
#
# Documents come from .txt files (one per file), records of .jsonl / .json (JSON lines or an array)
# / .csv files (those four also compressed: .gz .bz2 .xz .zst), .parquet / .arrow files, a directory
# or glob of such files, a directory written by `datasets`' save_to_disk, or a hub dataset id
# (streamed). All but plain .txt and .jsonl go through the `datasets` loaders. Batches of documents
# are tokenized in a process pool; results come back in input order, so the shards are the same for
# any --num-proc.

LOADERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet",
           ".arrow": "arrow"}  # suffix -> `datasets` loader
COMPRESSED = (".gz", ".bz2", ".xz", ".zst")  # of the first four
EOS_NAMES = ("</s>", "<|endoftext|>", "<eos>", "<|end_of_text|>")
# A tokenizer directory's files (tokenizer.json first): shards, checkpoints and exports carry those there are.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja")


def _hub_id(name: str) -> bool:
    """ORG/NAME, which the hub may hold, unless it looks local: it starts with . / ~, ends with / or
    .json, has a backslash, or its first part exists here. Any other name not here is not found."""
    return name.count("/") == 1 and not (name.startswith((".", "/", "~")) or name.endswith(("/", ".json"))
                                         or "\\" in name or Path(name.split("/")[0]).exists())


def _not_found(name: str) -> str:
    p = q = Path(name).expanduser()
    while not q.exists() and q != q.parent:
        q = q.parent  # the nearest part of the path that exists
    hint = "; a hub id is ORG/NAME" if "/" not in name and "." not in name else ""  # `gpt2`
    return f"{name}: not found ({q / p.relative_to(q).parts[0]} does not exist{hint})"


def load_tokenizer(name: str):
    """A `tokenizers.Tokenizer` from a directory holding tokenizer.json, the file, or a hub id
    (a name that looks like a path never goes to the hub)."""
    from tokenizers import Tokenizer  # the data extra: pip install 'pithtrain[data]'

    p = Path(name).expanduser()
    if p.is_dir():
        p = p / "tokenizer.json"
        if not p.is_file():
            raise FileNotFoundError(f"{p}: no tokenizer.json in the tokenizer directory")
    if p.is_file():
        return Tokenizer.from_file(str(p))
    if not _hub_id(name):
        raise FileNotFoundError(_not_found(name))
    return Tokenizer.from_pretrained(name)


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of the tokenizer as `tokenizers` serialises it (a Tokenizer, or a tokenizer.json
    path): the same tokenizer gives the same hash however its file was formatted."""
    if isinstance(tokenizer, (str, Path)):
        tokenizer = load_tokenizer(str(tokenizer))
    return hashlib.sha256(tokenizer.to_str().encode()).hexdigest()


def _iter_source(src: str, text_key: str, split: str):
    """(number of documents or None, iterator of document texts) of one input."""
    p = Path(src).expanduser()
    if any(c in src for c in "*?[") and not p.exists():
        files = sorted(Path(f) for f in glob.glob(str(p), recursive=True) if Path(f).is_file())
        return _iter_files(files, f"{src}: no file matches", text_key, split)
    if p.is_dir() and not any((p / f).is_file() for f in ("dataset_info.json", "state.json", "dataset_dict.json")):
        files = sorted(f for f in p.rglob("*") if f.is_file() and not any(
            part.startswith(".") for part in f.relative_to(p).parts))  # no hidden files (.DS_Store, .git)
        return _iter_files(files, f"{p}: an empty directory", text_key, split)
    suffix = Path(p.stem).suffix if p.suffix in COMPRESSED else p.suffix
    if p.is_file() and (suffix not in LOADERS or p.suffix in COMPRESSED and suffix in (".parquet", ".arrow")):
        raise ValueError(f"{p}: unknown input suffix {''.join(p.suffixes[-2:])!r}; prepare-data reads "
                         f"{' '.join(LOADERS)} files (the first four also {' '.join(COMPRESSED)}), directories "
                         "and globs of them, `datasets` save_to_disk directories and hub dataset ids")
    if p.is_file() and p.suffix == ".jsonl":
        with p.open("rb") as f:
            n = sum(1 for line in f if line.strip())
        return n, _iter_jsonl(p, text_key)
    if p.is_file() and p.suffix == ".txt":
        return 1, iter([p.read_bytes().decode("utf-8", errors="replace")])
    if not p.exists() and not _hub_id(src):
        raise FileNotFoundError(_not_found(src))
    import datasets  # the data extra: pip install 'pithtrain[data]'

    datasets.disable_progress_bars()  # ours counts documents
    if p.is_file():  # a compressed .txt is one document, as a plain one
        ds = datasets.load_dataset(LOADERS[suffix], data_files=str(p), split="train",
                                   **({"sample_by": "document"} if suffix == ".txt" else {}))
    elif p.is_dir():
        ds = datasets.load_from_disk(str(p))
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise ValueError(f"{p}: no split {split!r} (splits: {', '.join(ds)}; use --split)")
            ds = ds[split]
    else:
        ds = datasets.load_dataset(src, split=split, streaming=True)
    key = "text" if suffix == ".txt" else text_key
    cols = ds.column_names
    if cols is not None and key not in cols:
        raise ValueError(f"{src}: no {key!r} column (columns: {', '.join(cols)}; use --text-key)")
    n = len(ds) if isinstance(ds, datasets.Dataset) else None
    return n, (_text(rec[key], f"{src}: record {i + 1}", key) for i, rec in enumerate(ds))


def _iter_files(files: list[Path], none: str, text_key: str, split: str):
    """_iter_source of a glob's or a directory's files together; `none`: the error when there are none."""
    if not files:
        raise FileNotFoundError(none)
    opened = [_iter_source(str(f), text_key, split) for f in files]  # every file checked first
    counts = [n for n, _ in opened]
    return (None if None in counts else sum(counts)), (text for _, it in opened for text in it)


def _text(v, where: str, key: str) -> str:
    if not isinstance(v, str):  # a record without the field reads as None through `datasets`
        raise ValueError(f"{where}: {key!r} is {type(v).__name__}, not text (use --text-key)")
    return v


def _iter_jsonl(p: Path, text_key: str):
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
            yield _text(rec[text_key], f"{p}:{n}", text_key)


def _weighted(first, reopen, w: float):
    """An input's documents written w times: document j floor(w(j+1)) - floor(wj) times (2.5:
    2, 3, 2, 3, ...; 0.5: every other one), one copy per pass over the input, so that copies of a
    document never sit side by side."""
    for k in range(math.ceil(w)):
        for j, text in enumerate(first if k == 0 else reopen()[1]):
            if math.floor(w * (j + 1)) - math.floor(w * j) > k:
                yield text


_WORKER_TOKENIZER = None


def _init_worker(tokenizer_json: str):
    global _WORKER_TOKENIZER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the pool is the parallelism; no threads per worker
    from tokenizers import Tokenizer
    _WORKER_TOKENIZER = Tokenizer.from_str(tokenizer_json)


def _encode(texts: list[str], tokenizer=None) -> list[list[int]]:
    return [e.ids for e in (tokenizer or _WORKER_TOKENIZER).encode_batch(texts)]


def _batched(it, n: int):
    it = iter(it)
    while batch := list(itertools.islice(it, n)):
        yield batch


def declared_tokens(directory: str | Path) -> dict[str, str]:
    """bos_token, eos_token and pad_token as a tokenizer directory's tokenizer_config.json names them
    (a value may be the token or {"content": token, ...})."""
    try:
        d = json.loads((Path(directory).expanduser() / "tokenizer_config.json").read_text())
    except (OSError, ValueError):  # none, or not JSON (transformers would not read it either)
        return {}
    d = {k: v.get("content") if isinstance(v, dict) else v for k, v in d.items()} if isinstance(d, dict) else {}
    return {k: d[k] for k in ("bos_token", "eos_token", "pad_token") if isinstance(d.get(k), str)}


def added_around(tokenizer) -> tuple[list[int], list[int]]:
    """The ids the tokenizer's post-processor puts before and after a text (a BOS, an EOS: its
    template), as transformers' tokenizer(text) adds them at inference."""
    e = tokenizer.encode("hello world 0")
    text = np.flatnonzero(np.array(e.special_tokens_mask) == 0)  # the text's own tokens
    return (e.ids[:text[0]], e.ids[text[-1] + 1:]) if len(text) else (e.ids, [])


def find_eos(tokenizer, name: str | None, where: str) -> int:
    """The id of the document separator: `name` (--eos), else the token the post-processor ends a
    text with, else the eos_token of the directory `where` (`declared_tokens`), else the first of
    EOS_NAMES the tokenizer has."""
    after = [tokenizer.id_to_token(i) for i in added_around(tokenizer)[1][-1:]]
    names = [name] if name else [*after, declared_tokens(where).get("eos_token"), *EOS_NAMES]
    for n in filter(None, names):
        if (i := tokenizer.token_to_id(n)) is not None:
            return i
    special = ", ".join(t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special)
    why = f"--eos {name!r} is not one of its tokens" if name else f"no end-of-text token among {', '.join(EOS_NAMES)}"
    raise ValueError(f"{where}: {why}; pass the one that ends a document with --eos (its special tokens: "
                     f"{special or 'none'})")


def prepare_data(inputs: list[str], tokenizer_dir: str, out_dir: str, text_key: str = "text",
                 shard_tokens_max: int = 100_000_000, progress=True, num_proc: int = 1,
                 split: str = "train", batch_docs: int = 256, eos: str | None = None,
                 weights: list[float] | None = None) -> dict:
    """Tokenize documents (see above) with a Hugging Face tokenizer (a directory with
    tokenizer.json, the file, or a hub id) into shards of about shard_tokens_max tokens. A
    document is what the tokenizer makes of its text, its post-processor's tokens included (a BOS
    before it, as at inference), ending with the EOS token once (`find_eos`; none is an error):
    appended unless the post-processor already put it last.
    weights: how many times each input's documents are written (_weighted); meta.json's "inputs"
    records each one's documents and tokens. The tokenizer files are saved beside the shards and
    meta.json records its fingerprint, so training can check it (train.init_from, resume)."""
    from tqdm import tqdm

    tokenizer = load_tokenizer(tokenizer_dir)
    vocab = tokenizer.get_vocab_size()
    dtype = np.uint16 if vocab <= 65535 else np.uint32
    eos_id, before = find_eos(tokenizer, eos, tokenizer_dir), added_around(tokenizer)[0]
    weights = [1.0] * len(inputs) if weights is None else weights
    if len(weights) != len(inputs) or not all(0 < w < math.inf for w in weights):
        raise ValueError(f"--weights: {len(inputs)} numbers > 0 for the {len(inputs)} inputs, got {weights}")
    sources = [_iter_source(src, text_key, split) for src in inputs]  # every input checked before work
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    tok_dir = Path(tokenizer_dir).expanduser()
    for f in TOKENIZER_FILES[1:] if tok_dir.is_dir() else ():
        if (tok_dir / f).is_file():
            shutil.copyfile(tok_dir / f, out / f)
    files, buf, buf_tokens = [], [], 0  # buf_tokens: len of buf's arrays together

    def flush():  # buf as the next shard (written whole, then renamed), then emptied
        nonlocal buf_tokens
        if not buf:
            return
        arr = np.concatenate(buf).astype(dtype)
        name = f"shard_{len(files):05d}.bin"
        arr.tofile(out / (name + ".tmp"))
        os.replace(out / (name + ".tmp"), out / name)
        files.append({"name": name, "tokens": int(len(arr))})
        buf.clear()
        buf_tokens = 0

    counts = [None if n is None else math.floor(w * n) for (n, _), w in zip(sources, weights)]
    bar = tqdm(total=None if None in counts else sum(counts), unit="doc", desc="prepare-data",
               disable=not progress, file=sys.stderr)
    pool, per_input = None, []
    if num_proc > 1:
        import multiprocessing
        pool = multiprocessing.get_context().Pool(num_proc, _init_worker, (tokenizer.to_str(),))
    try:
        for src, w, (_, it) in zip(inputs, weights, sources):
            docs = _batched(_weighted(it, lambda src=src: _iter_source(src, text_key, split), w), batch_docs)
            encoded = pool.imap(_encode, docs) if pool else (_encode(b, tokenizer) for b in docs)  # in input order
            n_docs = n_tokens = 0
            for batch in encoded:
                for ids in batch:
                    buf.append(np.asarray(ids if ids[-1:] == [eos_id] else ids + [eos_id], dtype=np.int64))
                    buf_tokens += len(buf[-1])
                    n_tokens += len(buf[-1])
                    if buf_tokens >= shard_tokens_max:
                        flush()
                n_docs += len(batch)
                bar.update(len(batch))
            per_input.append({"input": src, "weight": w, "documents": n_docs, "tokens": n_tokens})
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
    flush()
    if not files:
        raise ValueError("no documents found in the inputs")
    meta = {"dtype": np.dtype(dtype).name, "vocab_size": vocab, "tokenizer": str(tokenizer_dir),
            "tokenizer_sha256": tokenizer_fingerprint(tokenizer), "eos_id": eos_id,
            "eos": tokenizer.id_to_token(eos_id), "bos_id": before[0] if before else None,
            "bos": tokenizer.id_to_token(before[0]) if before else None,
            "documents": sum(i["documents"] for i in per_input),
            "inputs": per_input, "files": files}
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    return meta


def summary(meta: dict, out: str) -> str:
    """prepare-data's last lines: documents, tokens, shards, vocabulary, EOS (and each input's share)."""
    tokens = sum(f["tokens"] for f in meta["files"])
    bos = f"BOS {meta['bos']!r} (id {meta['bos_id']}, its post-processor's)" if meta.get("bos") else "no BOS"
    lines = [f"prepare-data: {meta['documents']:,} documents, {tokens:,} tokens in {len(meta['files'])} "
             f"shard(s) ({meta['dtype']}) -> {out}; vocabulary {meta['vocab_size']:,}, EOS {meta['eos']!r} "
             f"(id {meta['eos_id']}), {bos}; tokenizer {meta['tokenizer']} (sha256 {meta['tokenizer_sha256'][:12]})"]
    if len(meta["inputs"]) > 1:
        lines += [f"  {i['input']}: {i['documents']:,} documents (x{i['weight']:g}), {i['tokens']:,} tokens "
                  f"({100 * i['tokens'] / tokens:.1f}%)" for i in meta["inputs"]]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Entry point (`invoke prepare-data` runs this)


def main(argv: list[str] | None = None) -> int:
    """python -m pithtrain.data --inputs a.jsonl,b.parquet,DIR --tokenizer DIR --out DIR [--num-proc N]"""
    import argparse
    p = argparse.ArgumentParser(prog="python -m pithtrain.data", description="Tokenize text files into "
                                "token shards (data.source: shards, data.path: OUT).")
    p.add_argument("--inputs", required=True, help="comma-separated .txt / .jsonl / .json / .csv (also .gz, .bz2, "
                   ".xz, .zst) / .parquet / .arrow files, directories or globs of them, `datasets` save_to_disk "
                   "directories, or a hub dataset id (streamed)")
    p.add_argument("--tokenizer", required=True, help="directory holding tokenizer.json, the file, or a hub id")
    p.add_argument("--out", required=True, help="output directory for the shards and meta.json")
    p.add_argument("--text-key", default="text", help="the text field of the records")
    p.add_argument("--split", default="train", help="the split of a dataset directory or hub dataset")
    p.add_argument("--num-proc", type=int, default=os.cpu_count() or 1, help="tokenizer processes")
    p.add_argument("--eos", help=f"the token that ends each document (default: the first of {', '.join(EOS_NAMES)})")
    p.add_argument("--weights", help="comma-separated, one per input: times its documents are written (2: twice, "
                   "0.5: every other one)")
    args = p.parse_args(argv)
    try:
        weights = [float(w) for w in args.weights.split(",")] if args.weights else None
        meta = prepare_data(args.inputs.split(","), tokenizer_dir=args.tokenizer, out_dir=args.out,
                            text_key=args.text_key, num_proc=args.num_proc, split=args.split, eos=args.eos,
                            weights=weights)
    except ImportError as e:
        print(f"error: {e}; install the data extra: pip install -e '.[data]'", file=sys.stderr)
        return 2
    except (OSError, ValueError) as e:  # a missing file, a record without the text field
        print(f"\nerror: {e}", file=sys.stderr)
        return 2
    print(summary(meta, args.out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
