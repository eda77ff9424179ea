"""Sample text from a training checkpoint with the run's tokenizer: a quick look at what it learned.

    python -m pithtrain.sample --ckpt runs/default --prompt "def " --tokens 200
    python -m pithtrain.sample --ckpt runs/default --temperature 0      # greedy: the same text every time
    invoke sample --ckpt runs/default

--ckpt takes a run directory, its checkpoints/ directory or a step_N directory (as export does).
The tokenizer is the one the run trained with: bytes for the stdlib data (a document starts with
BOS), else the tokenizer.json the checkpoint carries (the shards', from any working directory).
No KV cache: each new token runs the model over the last train.seq_len tokens, which is fine
for the few hundred tokens of a sanity check.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import yaml

from pithtrain.checkpoint.dcp import RECIPE, TRAINER, CheckpointError, resolve
from pithtrain.checkpoint.export import checkpoint_tokenizer, load_checkpoint_model
from pithtrain.config import ConfigError
from pithtrain.data import BOS, EOS


class ByteTokenizer:
    """The stdlib data's tokens: UTF-8 bytes, BOS before a document, EOS after it."""
    eos = EOS

    def encode(self, text: str) -> list[int]:
        return [BOS, *text.encode()]

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class FileTokenizer:
    """The tokenizer.json a checkpoint carries (trainer.json names its EOS token)."""

    def __init__(self, tok_file: Path, eos: int | None):
        from pithtrain.data import load_tokenizer
        self.tok, self.eos = load_tokenizer(str(tok_file)), eos

    def encode(self, text: str) -> list[int]:  # a new document follows a separator, as in training
        return ([self.eos] if self.eos is not None else []) + self.tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


def load_run(ckpt):
    """(model in eval mode on CPU, tokenizer, context length) of a checkpoint and its recipe."""
    path = resolve(ckpt)
    saved = yaml.safe_load((path / RECIPE).read_text())
    tok_file = checkpoint_tokenizer(path, saved)
    eos = (json.loads((path / TRAINER).read_text()).get("data") or {}).get("eos_id")
    tok = ByteTokenizer() if tok_file is None else FileTokenizer(tok_file, eos)
    return load_checkpoint_model(path), tok, int((saved.get("train") or {}).get("seq_len", 256))


@torch.no_grad()
def generate(model, ids: list[int], tokens: int, temperature: float, context: int, eos: int | None = None,
             seed: int = 0) -> list[int]:
    """`tokens` new ids after `ids` (fewer if EOS comes): argmax at temperature 0, else drawn from
    softmax(logits / temperature) with a generator seeded by `seed`."""
    g = torch.Generator().manual_seed(seed)
    out = list(ids)
    for _ in range(tokens):
        logits_V = model(torch.tensor([out[-context:]]))[0, -1].float()
        if temperature == 0:
            nxt = int(logits_V.argmax())
        else:
            nxt = int(torch.multinomial(torch.softmax(logits_V / temperature, dim=-1), 1, generator=g))
        out.append(nxt)
        if nxt == eos:
            break
    return out[len(ids):]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pithtrain.sample", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="run dir, checkpoints dir or step_N dir")
    p.add_argument("--prompt", default="", help="text to continue (default: a new document)")
    p.add_argument("--tokens", type=int, default=200, help="new tokens to draw")
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy (deterministic)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.temperature < 0 or args.tokens < 1:
        print("error: --temperature must be >= 0 and --tokens >= 1", file=sys.stderr)
        return 2
    try:
        model, tok, context = load_run(args.ckpt)
    except (CheckpointError, ConfigError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ids = tok.encode(args.prompt)
    if not ids:
        print("error: the prompt encodes to no tokens; give some text with --prompt", file=sys.stderr)
        return 2
    new = generate(model, ids, args.tokens, args.temperature, context, tok.eos, args.seed)
    print(args.prompt + tok.decode(new), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
