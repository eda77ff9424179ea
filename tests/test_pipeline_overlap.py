"""The paper's engine on gloo (CPU): DualPipeV with `parallel.pp_overlap: true` in pp=2 x fsdp=2 x ep=2
and pp=2 x dp=2 x ep=2 (4 processes each: ep borrows a stage's fsdp or dp ranks), for every family.
train.py end to end, 3 AdamW steps, equals one process running the same micro-batches (losses,
gradient norms, every parameter), and the recorded timeline shows every dispatch and combine
all-to-all of one micro-batch issued together with a compute phase of the other micro-batch in
every forward-backward pair of the steady state.

Tolerance (float32): the pipeline computes each micro-batch with the same kernels on the same shapes
as the single process; what differs is the order of sums: gradients are accumulated per phase and
per micro-batch in another order (B and W separately, DualPipeV finishes micro-batches out of
order), reduced over ranks by FSDP's reduce-scatter / all-reduce, and each expert's rows arrive in
another order after the all-to-all: float32 round-off, gradients within ~1e-7 relative of the
tensor's scale. AdamW then normalises each element: with eps 1e-8 an element whose gradient is a
cancellation at round-off level (measured 2026-12-01, Qwen3 pp=2 x dp=2 x ep=2: one embedding
entry of 4.4e-9 in a row of ~1e-3 entries, 2.7e-9 in the pipeline) moves by a sizeable fraction
of lr either way, whatever the code. So these runs use train.eps = 1e-6: elements with
|g| >> 1e-6 (nearly all) still get AdamW's normalised update, those within round-off of zero get
one proportional to g (~lr * 1e-9 / 1e-6). Checked: losses and gradient norms rel 1e-5,
parameters rtol 1e-5 / atol 2e-5 (tests/test_pipeline.py's bounds; observed worst is printed)."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import variant
from ranks import spawn

TINY = {
    "qwen3_moe": dict(vocab_size=264, hidden_size=16, num_layers=4, num_heads=2, num_kv_heads=1, head_dim=8,
                      intermediate_size=24, moe_intermediate_size=8, num_experts=4, top_k=2, aux_loss_coeff=0.01),
    "deepseek_v2": dict(vocab_size=264, hidden_size=16, num_layers=4, num_heads=2, kv_lora_rank=8,
                        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, first_k_dense_replace=1,
                        intermediate_size=24, moe_intermediate_size=8, num_experts=4, n_shared_experts=1,
                        top_k=2, aux_loss_coeff=0.01),
    "gpt_oss": dict(vocab_size=264, hidden_size=16, num_layers=4, num_heads=2, num_kv_heads=1, head_dim=8,
                    intermediate_size=8, num_experts=4, top_k=2, sliding_window=4, aux_loss_coeff=0.01),
}
LAYOUTS = {"fsdp": dict(pp=2, fsdp=2, ep=2), "dp": dict(pp=2, dp=2, ep=2)}
MBS, SEQ, M = 2, 8, 4


def cfg_for(family, parallel, run_dir, grad_accum=M):
    from pithtrain.config import config_from_dict
    return config_from_dict({
        "model": variant.model({"family": family, **TINY[family]}),
        "train": dict(steps=3, micro_batch_size=MBS, seq_len=SEQ, grad_accum=grad_accum, warmup_steps=1,
                      device="cpu", eps=1e-6),
        "data": dict(max_bytes=20000), "parallel": parallel, "checkpoint": dict(final=False),
        "log": dict(every=1, run_dir=run_dir)})


def _worker(rank, world, port, cases, out_dir):
    from torch.distributed.tensor import DTensor

    from pithtrain.train import train
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for family, layout in cases:
            parallel = dict(LAYOUTS[layout], pp_schedule="dualpipev", pp_overlap=True)
            hist, model = train(cfg_for(family, parallel, os.path.join(out_dir, f"{family}-{layout}")))
            params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach()
                      for n, p in model.named_parameters()}
            torch.save({"hist": hist, "params": params}, os.path.join(out_dir, f"{family}-{layout}.{rank}.pt"))
    finally:
        dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def steady_state_pairs(timeline: dict) -> int:
    """Assert that in every overlapped forward-backward op (F&B) every dispatch / combine phase of
    either micro-batch was issued in one pairing step with a compute phase of the other (on CUDA:
    on the communication stream while that compute runs); returns how many there were."""
    phases = timeline["phases"]
    n = 0
    for op in {e["op"] for e in phases if "+" in e["op"]}:  # "F<c>.<mb>+BW<c>.<mb>"
        mine = [e for e in phases if e["op"] == op]
        for e in mine:
            if not e["comm"]:
                continue
            partner = [o for o in mine if o["pair"] == e["pair"] and o is not e]
            assert e["pair"] is not None and len(partner) == 1, (op, e["phase"], e["pass_"])
            assert not partner[0]["comm"] and partner[0]["mb"] != e["mb"], (op, e, partner)
            assert partner[0]["stream"] == "compute" and e["stream"] in ("compute", "comm")
            n += 1
    return n


def test_dualpipev_overlap_matches_one_process_for_every_family(tmp_path):
    """Both layouts of every family in one 4-process launch; both have 2 batch ranks, so one
    reference per family serves both."""
    import json

    from pithtrain.train import train
    cases = [(f, layout) for f in sorted(TINY) for layout in sorted(LAYOUTS)]
    spawn(_worker, args=(4, free_port(), cases, str(tmp_path)), nprocs=4)
    refs = {}
    for family, layout in cases:
        if family not in refs:
            cfg = cfg_for(family, {}, str(tmp_path / f"ref-{family}"), grad_accum=2 * M)  # 2 batch ranks
            ref, model = train(cfg)
            refs[family] = ref, {n: p.detach() for n, p in model.named_parameters()}
        ref, ref_params = refs[family]
        got = [torch.load(tmp_path / f"{family}-{layout}.{r}.pt") for r in range(4)]
        assert len(got[0]["hist"]) == len(ref) == 3
        for a, b in zip(got[0]["hist"], ref):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (family, layout)
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), (family, layout)
        params = {k: v for g in got for k, v in g["params"].items()}
        assert params.keys() == ref_params.keys()
        worst = 0.0
        for n in params:
            torch.testing.assert_close(params[n], ref_params[n], rtol=1e-5, atol=2e-5,
                                       msg=lambda m: f"{family} {layout}: {n}: {m}")
            worst = max(worst, (params[n] - ref_params[n]).abs().max().item())
        run_dir = tmp_path / f"{family}-{layout}" / "pipeline_timeline"
        pairs = [steady_state_pairs(json.loads((run_dir / f"rank{r}.json").read_text())) for r in range(4)]
        assert all(p > 0 for p in pairs), pairs  # every rank overlapped some all-to-all
        if family == "qwen3_moe" and layout == "fsdp":  # the drawing: all-to-all lane above the compute ops
            from pithtrain import pipeline_viz
            assert pipeline_viz.main([str(tmp_path / f"{family}-{layout}")]) == 0
            assert (run_dir / "timeline.png").stat().st_size > 0
        print(f"{family} pp=2 x {layout}=2 x ep=2: losses {[h['loss'] for h in got[0]['hist']]}, "
              f"max |param - ref| {worst:.1e}, overlapped all-to-all phases per rank {pairs}")


def _fsdp_w_worker(rank, world, port, out_dir):
    """fsdp=2 on one chunk holding every layer: B leaves every gradient unreduced, W reduce-scatters
    each layer's (and the root's) into the sharded `.grad`, before the step's end."""
    from torch.distributed.tensor import DTensor

    from pithtrain.distributed import overlap, pipeline
    from pithtrain.distributed.parallel_dims import ParallelDims
    from pithtrain.distributed.parallelize import materialize, parallelize
    from pithtrain.distributed.schedule import Chunk
    from pithtrain.models import build_model
    from pithtrain.precision import Precision
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        cfg = cfg_for("deepseek_v2", dict(fsdp=2, ep=2), out_dir)
        dims = ParallelDims.from_config(cfg, world_size=world, rank=rank).build_meshes("cpu")
        model = pipeline.attach_ends(build_model(cfg.model, init=False))
        parallelize(model, dims, cfg.train, torch.device("cpu"), Precision())
        pipeline.register_fsdp_methods(model)
        materialize(model, build_model(cfg.model, init=False), torch.device("cpu"), cfg.train.seed)
        g = torch.Generator().manual_seed(5)
        ids = torch.randint(0, 264, (2, MBS, SEQ + 1), generator=g)[rank]  # each rank its own rows
        x, y = ids[:, :-1], ids[:, 1:]
        model.pipeline_begin()
        chunk = Chunk(0, list(range(cfg.model.num_layers)), first=True, last=True)
        run = overlap.start(overlap.chunk_phases(model, chunk, torch.arange(SEQ).expand_as(x), y), x, fsdp=True)
        overlap.forward(run)
        overlap.backward(run, torch.tensor(1.0), input_only=True)
        after_b = sum(p.grad is not None for p in model.parameters())
        overlap.weight_backward(run)
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if isinstance(p.grad, DTensor)}
        overlap.finish_fsdp(model)
        torch.save({"after_b": after_b, "n": len(list(model.parameters())), "grads": grads},
                   os.path.join(out_dir, f"w.{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_fsdp_reduce_scatter_is_deferred_to_w(tmp_path):
    from pithtrain.distributed.parallelize import materialize
    from pithtrain.models import build_model
    spawn(_fsdp_w_worker, args=(2, free_port(), str(tmp_path)), nprocs=2)
    cfg = cfg_for("deepseek_v2", {}, str(tmp_path))
    ref = build_model(cfg.model, init=False)
    materialize(ref, build_model(cfg.model, init=False), torch.device("cpu"), cfg.train.seed)
    ids = torch.randint(0, 264, (2, MBS, SEQ + 1), generator=torch.Generator().manual_seed(5))
    for r in range(2):
        ref(ids[r, :, :-1], labels_BS=ids[r, :, 1:]).backward()
    res = torch.load(tmp_path / "w.0.pt")
    assert res["after_b"] == 0  # B: no gradient reached any (sharded) parameter
    assert res["grads"].keys() == {n for n, _ in ref.named_parameters()}  # W: every one reduced
    for n, p in ref.named_parameters():
        torch.testing.assert_close(res["grads"][n], p.grad, rtol=1e-5, atol=1e-7, msg=lambda m: f"{n}: {m}")


def test_pp_overlap_where_it_cannot_apply_is_a_config_error(tmp_path):
    from pithtrain.config import ConfigError
    from pithtrain.distributed.parallel_dims import ParallelDims
    for parallel, why in ((dict(fsdp=2, ep=2), "needs a pipeline"),
                          (dict(pp=2, fsdp=2, ep=2, pp_schedule="1f1b"), "needs pp_schedule=dualpipev"),
                          (dict(pp=2, pp_schedule="dualpipev"), r"needs expert parallelism \(ep > 1\)")):
        with pytest.raises(ConfigError, match=f"parallel.pp_overlap: {why}.*; set parallel.pp_overlap=false"):
            cfg_for("qwen3_moe", dict(parallel, pp_overlap=True), str(tmp_path))
    cfg = cfg_for("qwen3_moe", dict(LAYOUTS["fsdp"], pp_schedule="dualpipev", pp_overlap=True), str(tmp_path))
    cfg.train.activation_checkpoint = "full"
    with pytest.raises(ConfigError, match="pp_overlap: activation checkpointing runs each layer whole"):
        ParallelDims.from_config(cfg, world_size=4, rank=0)  # with the layout, before any model
