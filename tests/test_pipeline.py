"""Pipeline parallelism on gloo: pp=2 and pp=4, 1F1B and DualPipeV, and pp=2 x fsdp=2 x ep=2, give
the loss and the gradients of one process running the same micro-batches (float32); train.py end to
end (3 AdamW steps) with pp=2 DualPipeV and with pp=2 x fsdp=2 x ep=2 DualPipeV gives the same
losses, gradient norms and weights.

Tolerance: the pipeline computes every micro-batch with the same kernels on the same shapes as the
single process; what differs is the order in which gradients are summed (DualPipeV finishes
micro-batches out of order; B/W split sums input and weight paths separately; FSDP reduces over
ranks). Observed (2026-11-29): gradients within 4e-8 absolute (often bit-equal), summed losses
within 1e-7 relative, weights after 3 AdamW steps within 7e-6 (Adam divides by sqrt(v), which
magnifies tiny gradients' round-off). Checked at rtol 1e-5 / atol 1e-7 (gradients), rtol 1e-5 /
atol 2e-5 (weights)."""

import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import variant
from ranks import spawn

from pithtrain.distributed import pipeline
from pithtrain.models.common import set_aux_loss_scale
from pithtrain.models.deepseek_v2 import DeepseekV2Config, DeepseekV2ForCausalLM
from pithtrain.models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeForCausalLM
from pithtrain.precision import Precision

CFG = dict(vocab_size=264, hidden_size=32, num_layers=6, num_heads=4, num_kv_heads=2, head_dim=8,
           intermediate_size=48, moe_intermediate_size=16, num_experts=4, top_k=2, mlp_only_layers=[0],
           aux_loss_coeff=0.01)
# Cases named *_mla: DeepSeek's attention with d_v (12) != d_qk (16), which takes SDPA's composite
# path on CPU: its backward differs when run under autocast (issue #49), so it proves the pipeline
# runs backward outside autocast, as the one-process step does.
MLA_CFG = dict(vocab_size=264, hidden_size=32, num_layers=6, num_heads=2, kv_lora_rank=16, qk_nope_head_dim=8,
               qk_rope_head_dim=8, v_head_dim=12, intermediate_size=48, moe_intermediate_size=16, num_experts=4,
               top_k=2, first_k_dense_replace=1, aux_loss_coeff=0.01)
MBS, SEQ = 2, 16


def build(seed=0, name=""):
    torch.manual_seed(seed)
    if name.endswith("_mla"):
        model = DeepseekV2ForCausalLM(DeepseekV2Config(**variant.model(MLA_CFG, "deepseek_v2")))
    else:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**variant.model(CFG, "qwen3_moe")))
    model.init_weights()
    return model


def micro_batches(M, seed=7):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, CFG["vocab_size"], (M * MBS, SEQ + 1), generator=g)
    x, y = ids[:, :-1].clone(), ids[:, 1:].clone()
    y[::3, :4] = -100  # some ignored targets: the denominator is the global target count
    return [(x[m * MBS:(m + 1) * MBS], y[m * MBS:(m + 1) * MBS]) for m in range(M)], int((y != -100).sum())


def precision_for(name):
    """Cases named bf16_*: bf16 autocast on the step's bf16 weight copy (precision.WeightCopies),
    as train.py runs without FSDP on a GPU; the residual stream, and so what travels between
    stages, is bf16. The others: float32."""
    return Precision(torch.bfloat16, "cpu", copy="all") if name.startswith("bf16") else Precision()


def reference(M, name=""):
    """One process, M micro-batches, loss_sum / global target count per micro-batch: train.py's
    forward_backward (forward under autocast, backward outside it)."""
    from pithtrain.train import forward_backward
    model = build(name=name)
    set_aux_loss_scale(model, 1.0 / M)
    mbs, denom = micro_batches(M)
    precision = precision_for(name)
    with precision.weights(model):
        total = forward_backward(model, [(x, y, None, None) for x, y in mbs], denom, precision)[0].item()
    return total, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.quick
def test_checkpointing_and_compile_apply_to_a_pipeline_stage():
    """A stage's `layers` is a ModuleDict keyed by layer index (prune_model): activation
    checkpointing and compile walk its layers, and the stage's layers compute what they did."""
    from pithtrain.compile import apply_activation_checkpoint, apply_compile
    ref, model = build(), build()
    chunk = pipeline.rank_chunks(0, 2, "1f1b", CFG["num_layers"])[0]
    pipeline.prune_model(model, [chunk])
    apply_activation_checkpoint(model, "full")
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    apply_compile(model, backend="eager")
    x = micro_batches(1)[0][0][0]
    rope = ref.rotary(torch.arange(SEQ).expand_as(x))
    h_ref = h = ref.embed_tokens(x)
    for i in chunk.layer_ids:
        h_ref, h = ref.layers[i](h_ref, rope), model.layers[str(i)](h, rope)
    torch.testing.assert_close(h, h_ref, rtol=1e-6, atol=1e-6)
    assert counters["stats"]["unique_graphs"] >= 3, dict(counters["stats"])  # the stage's layers compiled
    assert len(chunk.layer_ids) == CFG["num_layers"] // 2


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_cfg(parallel: dict, run_dir: str):
    from pithtrain.config import config_from_dict
    return config_from_dict({
        "model": variant.model({"family": "qwen3_moe", **CFG}),
        "train": dict(steps=3, micro_batch_size=MBS, seq_len=SEQ, grad_accum=4, warmup_steps=1, device="cpu"),
        "data": dict(max_bytes=20000), "parallel": parallel, "checkpoint": dict(final=False),
        "log": dict(every=1, run_dir=run_dir)})


def train_name(parallel):
    return "-".join(f"{k}{v}" for k, v in sorted(parallel.items()))


def _train(rank, world, parallel, out_dir):
    """train.py end to end (3 AdamW steps) under the pipeline."""
    from torch.distributed.tensor import DTensor

    from pithtrain.train import train
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    name = train_name(parallel)
    hist, model = train(train_cfg(parallel, os.path.join(out_dir, f"run-{name}")))
    params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach()
              for n, p in model.named_parameters()}
    torch.save({"hist": hist, "params": params}, os.path.join(out_dir, f"train-{name}.{rank}.pt"))


def check_train(tmp_path, world, parallel):
    """3 AdamW steps through train.py equal one process running the same micro-batches
    (grad_accum x batch ranks of them): losses, gradient norms, updated weights."""
    from pithtrain.train import train
    batch_ranks = parallel.get("fsdp", 1) * parallel.get("dp", 1)
    cfg = train_cfg({}, str(tmp_path / f"ref{batch_ranks}"))
    cfg.train.grad_accum *= batch_ranks
    ref, model = train(cfg)
    ref_params = {n: p.detach() for n, p in model.named_parameters()}
    name = train_name(parallel)
    got = [torch.load(tmp_path / f"train-{name}.{r}.pt") for r in range(world)]
    assert len(got[0]["hist"]) == len(ref) == 3
    for a, b in zip(got[0]["hist"], ref):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    params = {k: v for g in got for k, v in g["params"].items()}
    assert params.keys() == ref_params.keys()
    worst = 0.0
    for n in params:
        torch.testing.assert_close(params[n], ref_params[n], rtol=1e-5, atol=2e-5, msg=lambda m: f"{n}: {m}")
        worst = max(worst, (params[n] - ref_params[n]).abs().max().item())
    print(f"train.py {name}: losses {[h['loss'] for h in got[0]['hist']]} vs "
          f"{[h['loss'] for h in ref]}, max |param - ref| after 3 AdamW steps {worst:.1e}")


def _worker(rank, world, port, cases, out_dir, ep_cases=(), train_cases=()):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for parallel in train_cases:
            _train(rank, world, parallel, out_dir)
        for name, schedule, M in ep_cases:
            _pp_fsdp_ep(rank, world, name, schedule, M, out_dir)
        group_f, group_b = pipeline.new_pp_groups([list(range(world))])
        for name, schedule, M, layers in cases:
            model = build(name=name)
            chunks = pipeline.rank_chunks(rank, world, schedule, CFG["num_layers"], layers)
            pipeline.prune_model(model, chunks)
            ops = pipeline.build_schedule(schedule, world, M)[rank]
            precision = precision_for(name)
            runner = pipeline.PipelineRunner(model, chunks, ops, rank, world, schedule, M, group_f, group_b,
                                             (MBS, SEQ, CFG["hidden_size"]), torch.device("cpu"), precision=precision)
            set_aux_loss_scale(model, 1.0 / M)
            mbs, denom = micro_batches(M)
            runner.timeline = []
            with precision.weights(model):
                loss = runner.step(mbs, denom)
            grads = {n: p.grad for n, p in model.named_parameters()}
            torch.save({"loss": loss, "grads": grads, "timeline": runner.timeline},
                       os.path.join(out_dir, f"{name}.{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _pp_fsdp_ep(rank, world, name, schedule, M, out_dir):
    """pp=2 x fsdp=2 x ep=2 on 4 ranks: each stage's two ranks shard its dense weights (FSDP) and
    split its experts (EP, all-to-all dispatch), each reads its own rows (M micro-batches each)."""
    from pithtrain.config import config_from_dict
    from pithtrain.distributed.parallel_dims import ParallelDims
    from pithtrain.distributed.parallelize import materialize, parallelize
    from pithtrain.models import build_model

    cfg = config_from_dict({"model": variant.model({"family": "qwen3_moe", **CFG}),
                            "train": {"seq_len": SEQ, "micro_batch_size": MBS, "grad_accum": M},
                            "parallel": {"pp": 2, "fsdp": 2, "ep": 2, "pp_schedule": schedule}})
    dims = ParallelDims.from_config(cfg, world_size=world, rank=rank).build_meshes("cpu")
    pp_rank = dims.pp_rank
    group_f, group_b = pipeline.new_pp_groups([[0, 2], [1, 3]])
    model = build_model(cfg.model, "cpu", init=False)
    chunks = pipeline.rank_chunks(pp_rank, 2, schedule, CFG["num_layers"])
    pipeline.prune_model(model, chunks)
    parallelize(model, dims, cfg.train, torch.device("cpu"), Precision())
    pipeline.register_fsdp_methods(model)
    materialize(model, build_model(cfg.model, "cpu", init=False), torch.device("cpu"), 0)  # build()'s seed
    ops = pipeline.build_schedule(schedule, 2, M)[pp_rank]
    runner = pipeline.PipelineRunner(model, chunks, ops, pp_rank, 2, schedule, M, group_f, group_b,
                                     (MBS, SEQ, CFG["hidden_size"]), torch.device("cpu"))
    set_aux_loss_scale(model, 1.0 / (M * dims.data_parallel_size))
    mbs, denom = micro_batches(M * dims.data_parallel_size)
    mine = [mbs[m * dims.data_parallel_size + dims.data_parallel_rank] for m in range(M)]  # data.rows
    runner.timeline = []
    loss = runner.step(mine, denom)
    grads = {}
    for n, p in model.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grads[n] = g
    if dims.data_parallel_rank == 1:  # the other stage rank's gradients are the same full tensors
        grads = {}
    torch.save({"loss": loss, "grads": grads, "timeline": runner.timeline},
               os.path.join(out_dir, f"{name}.{rank}.pt"))


def check(out_dir, name, world, M):
    ref_loss, ref = reference(M, name)
    got = {}
    losses = []
    for r in range(world):
        res = torch.load(os.path.join(out_dir, f"{name}.{r}.pt"))
        losses.append(res["loss"])
        assert res["timeline"], (name, r)
        for n, g in res["grads"].items():
            assert n not in got, f"{name}: {n} held by two ranks"
            got[n] = g
    assert sum(losses) == pytest.approx(ref_loss, rel=1e-6), (name, losses)
    assert got.keys() == ref.keys(), (name, set(ref) ^ set(got))
    worst = 0.0
    for n in ref:
        assert got[n] is not None, (name, n)
        torch.testing.assert_close(got[n], ref[n], rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {n}: {m}")
        worst = max(worst, (got[n] - ref[n]).abs().max().item())
    print(f"{name} on {world} ranks: loss {sum(losses):.8g} vs {ref_loss:.8g}, "
          f"max |grad - ref| {worst:.1e}")


def run_world(world, cases, tmp_path, ep_cases=(), train_cases=()):
    spawn(_worker, args=(world, free_port(), cases, str(tmp_path), ep_cases, train_cases),
             nprocs=world)
    for name, _, M, _ in cases:
        check(str(tmp_path), name, world, M)
    for name, _, M in ep_cases:
        check(str(tmp_path), name, world, 2 * M)


def test_pp2_1f1b_and_dualpipev_match_one_process(tmp_path):
    train_cases = [dict(pp=2, pp_schedule="dualpipev")]
    run_world(2, [("1f1b", "1f1b", 4, None), ("dualpipev", "dualpipev", 4, None),
                  ("dualpipev_layers", "dualpipev", 5, [0, 3, 1, 2]),
                  ("bf16_1f1b", "1f1b", 4, None), ("bf16_dualpipev", "dualpipev", 4, None),
                  ("bf16_dualpipev_mla", "dualpipev", 4, None)],
              tmp_path, train_cases=train_cases)
    check_train(tmp_path, 2, train_cases[0])
    run_dir = tmp_path / f"run-{train_name(train_cases[0])}"
    assert {"rank0.json", "rank1.json"} <= {p.name for p in (run_dir / "pipeline_timeline").iterdir()}
    from pithtrain import pipeline_viz
    assert pipeline_viz.main([str(run_dir)]) == 0


def test_pp4_1f1b_and_dualpipev_and_pp2_fsdp2_ep2_match_one_process(tmp_path):
    train_cases = [dict(pp=2, fsdp=2, ep=2, pp_schedule="dualpipev")]
    run_world(4, [("1f1b", "1f1b", 6, None), ("dualpipev", "dualpipev", 8, None)], tmp_path,
              ep_cases=[("ep_1f1b", "1f1b", 2), ("ep_dualpipev", "dualpipev", 4)], train_cases=train_cases)
    check_train(tmp_path, 4, train_cases[0])


def test_paper_config_script_runs_its_layout_on_8_gloo_processes(tmp_path):
    """scripts/paper_config.py (issue 11's one command) in --smoke mode: the paper's layout
    (pp=4 x fsdp=2 x ep=2, world 8) with tiny widths on CPU, DualPipeV with the overlap and 1F1B
    (--only: DualPipeV without the overlap is the same path with the switch off, which the pipeline
    overlap tests cover); every rank materialises only its own blocks. Both give the same losses
    (the same function); the overlap run's timeline shows overlapped all-to-alls on every rank,
    1F1B's none. An unknown run name is refused before anything runs."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    script = [sys.executable, str(root / "scripts" / "paper_config.py"), "--smoke", "--steps", "1", "--loss-steps", "0",
              "--out", str(tmp_path)]
    p = subprocess.run([*script, "--only", "1f1b", "dualpipev-loss"], capture_output=True, text=True, cwd=root,
                       timeout=60)
    assert p.returncode == 2 and "--only dualpipev-loss: --loss-steps is 0 (it skips that run)" in p.stderr
    assert not tmp_path.joinpath("log.txt").exists()  # refused before anything is written
    p = subprocess.run([*script, "--only", "1f1b", "dualpipev"], capture_output=True, text=True, cwd=root, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr + (tmp_path / "log.txt").read_text()[-3000:]
    runs = json.loads((tmp_path / "paper.json").read_text())["runs"]
    assert [r["run"] for r in runs] == ["dualpipev", "1f1b"]  # the script's order
    assert all(len(r["peak_mem_gb_per_rank"]) == 8 and r["finite"] for r in runs)
    assert min(runs[0]["overlapped_all_to_all_per_rank"]) > 0  # the overlap ran on every rank
    assert max(runs[1]["overlapped_all_to_all_per_rank"]) == 0
    assert runs[0]["loss_last"] == pytest.approx(runs[1]["loss_last"], rel=1e-5)
