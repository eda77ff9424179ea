"""Seeded block initialisation: a model is initialised block by block (embedding, each layer, final
norm, head), each block from a generator seeded by (run seed, block name), so a pipeline stage or a
sharded rank that builds only its own blocks starts where one process does
(distributed/parallelize.py `materialize`). What a block's values are is the family's
`init_block` (usually common.init_normal).
"""

from __future__ import annotations

import zlib

import torch
from torch import nn


def model_blocks(model: nn.Module):
    """(name, block) for the pieces a model is initialised by: each child, and each layer of a
    ModuleList / ModuleDict child (`layers`, or the ModuleDict a pipeline stage keeps), named as in
    named_parameters. Children a pipeline stage dropped (None) are skipped."""
    for name, child in model.named_children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            for sub, layer in child.named_children():
                yield f"{name}.{sub}", layer
        elif child is not None:
            yield name, child


def init_block_seeded(block: nn.Module, name: str, init_block, seed: int):
    """Run `init_block(block)` with the CPU generator, and the generators of the GPUs the block is
    on, seeded by (seed, block name); every generator's state is as it was afterwards."""
    cuda = sorted({t.device.index or 0 for t in block.parameters() if t.is_cuda})
    block_seed = (seed * 1_000_003 + zlib.crc32(name.encode())) % 2 ** 63
    with torch.random.fork_rng(devices=cuda):  # only the generators seeded below, restored after
        torch.default_generator.manual_seed(block_seed)
        for d in cuda:
            torch.cuda.default_generators[d].manual_seed(block_seed)
        init_block(block)


def init_by_block(model: nn.Module, init_block, seed: int | None = None):
    """Initialise `model` block by block (model_blocks), each from its own seeded generator; seed
    defaults to torch.initial_seed(), the run's torch.manual_seed. A block initialised alone gets
    the same values, so a pipeline stage or a sharded rank builds only the blocks it holds, one at
    a time (distributed.parallelize.materialize), and still starts where one process does."""
    seed = torch.initial_seed() if seed is None else seed
    for name, block in model_blocks(model):
        init_block_seeded(block, name, init_block, seed)
