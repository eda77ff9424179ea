"""Distributed training on torch.distributed: PP x DP x FSDP x CP, with EP borrowed from FSDP x CP.

    parallel_dims.py     ParallelDims: the layout from the recipe, its checks, the DeviceMeshes
    parallelize.py       parallelize(): EP -> CP -> activation checkpointing -> compile -> FSDP;
                         materialize(): to_empty + the single-process initialisation, block by block
    expert_parallel.py   the all-to-all dispatcher (deduplicated), a drop-in for LocalDispatcher
    context_parallel.py  load-balanced sequence chunks and attention across them
    reductions.py        global loss sum, gradient norm/clipping over DTensors, expert load
    pipeline.py          pipeline stages, 1F1B / DualPipeV schedules and their executor
    overlap.py           a layer as phases; the overlapped forward-backward step
"""
