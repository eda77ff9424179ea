"""Distributed training on torch.distributed: PP x DP x FSDP x CP, with EP borrowed from a stage's ranks.

    parallel_dims.py     ParallelDims: the layout from the recipe, its checks, the DeviceMeshes
    parallelize.py       parallelize(): EP -> CP -> activation checkpointing -> compile -> FSDP;
                         materialize(): to_empty + the single-process initialisation, block by block
    expert_parallel.py   the all-to-all dispatcher (deduplicated), a drop-in for LocalDispatcher
    context_parallel.py  load-balanced sequence chunks and attention across them
    reductions.py        global loss sum, gradient norm/clipping over DTensors, expert load
    schedule.py          1F1B / DualPipeV schedules as op lists, simulator, cost model (torch-free)
    pipeline.py          pipeline stages and the executor of a rank's op list
    overlap.py           a chunk as layer phases (driving FSDP); the overlapped forward-backward step
"""
