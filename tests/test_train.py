import json
import math

import pytest
from ranks import spawn

from pithtrain.config import load_config
from pithtrain.metrics import flops_per_token, matmul_params
from pithtrain.models.qwen3_moe import Qwen3MoeConfig
from pithtrain.train import main, train


@pytest.mark.quick
def test_short_run_loss_decreases_and_prints_progress(tiny_overrides, tmp_path, capsys):
    cfg = load_config(None, tiny_overrides)
    hist, _ = train(cfg)
    out = capsys.readouterr().out
    assert "step     30 | loss" in out and "tok/s" in out
    assert len(hist) == 30
    first = sum(h["loss"] for h in hist[:3]) / 3
    last = sum(h["loss"] for h in hist[-3:]) / 3
    assert first > 4.5  # starts near ln(264) = 5.58
    assert last < first - 1.5, (first, last)
    assert all(math.isfinite(h["loss"]) and h["grad_norm"] > 0 for h in hist)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    recs = [json.loads(line) for line in lines]
    assert [r["step"] for r in recs] == [10, 20, 30]
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "mfu", "mem_gb", "imbalance"} <= recs[0].keys()


def test_a_setting_that_cannot_act_is_said_once(tiny_overrides, capsys):
    """train.compile on CPU (compile acts on CUDA only) and a warm-up past the last step: each one
    line at start-up, and the first step's phase line does not announce a compilation (#50)."""
    cfg = load_config(None, tiny_overrides + ["train.steps=4", "train.warmup_steps=5", "train.compile=true",
                                              "log.every=4"])
    hist, _ = train(cfg)
    out = capsys.readouterr().out
    assert out.count("pithtrain: train.compile=true: off on cpu, the layers run eagerly") == 1
    assert "pithtrain: first step ...\n" in out and "compiling" not in out
    assert out.count("pithtrain: WARNING: train.warmup_steps 5 > train.steps 4: the run ends in its warm-up, "
                     "the last step at 80% of train.lr") == 1
    assert hist[-1]["lr"] == pytest.approx(0.8 * cfg.train.lr)


def test_grad_accum_matches_one_big_batch(tiny_overrides):
    """2 micro-batches of 4 rows train exactly like 1 of 8 (same rows, loss normalised per token).
    The load-balancing loss is a per-micro-batch statistic (as in Megatron and Hugging Face), so it
    is switched off here to make the two runs the same function."""
    base = [o for o in tiny_overrides if not o.startswith(("train.steps", "train.micro"))]
    base += ["train.steps=4", "model.aux_loss_coeff=0"]
    # one run dir: without resume=False, b would resume from a's final checkpoint and train nothing
    a, _ = train(load_config(None, base + ["train.micro_batch_size=4", "train.grad_accum=2"]), resume=False)
    b, _ = train(load_config(None, base + ["train.micro_batch_size=8", "train.grad_accum=1"]), resume=False)
    assert len(a) == len(b) == 4
    for ra, rb in zip(a, b):
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-5)
        assert ra["grad_norm"] == pytest.approx(rb["grad_norm"], rel=1e-4)


@pytest.mark.quick
def test_flops_formula_against_hand_count():
    cfg = Qwen3MoeConfig(vocab_size=100, hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1,
                         head_dim=4, moe_intermediate_size=6, num_experts=4, top_k=2,
                         intermediate_size=10, mlp_only_layers=[0])
    # layer 0 (dense): q,o 8*8 each; k,v 8*4 each; mlp 3*8*10        = 128 + 64 + 240 = 432
    # layer 1 (MoE): attention 192; router 8*4 = 32; 2 of 4 experts 3*8*6 = 144 each -> 192+32+288 = 512
    # LM head 100*8 = 800. Touched matmul params = 432 + 512 + 800 = 1744
    # attention: 2 layers * 3 * seq(16) * (4 + 4) * 2 heads = 1536
    assert matmul_params(cfg) == (432 + (192 + 32 + 4 * 144) + 800, 1744)
    assert flops_per_token(cfg, 16) == 6 * 1744 + 1536


def test_a_non_finite_gradient_stops_before_the_update(tiny_overrides, tmp_path, monkeypatch, capsys):
    """Step 2's gradient norm is NaN: the run stops with a message and exit code 1, before the
    optimizer writes it into the weights, so the step-1 checkpoint is the newest and is finite."""
    import torch

    import pithtrain.train as train_mod
    from pithtrain.checkpoint.dcp import load_model_weights, resolve
    from pithtrain.models import build_model
    real, calls = train_mod.grad_norm, []

    def nan_on_step_2(*args):
        calls.append(1)
        norm = real(*args)
        return float("nan") if len(calls) == 2 else norm

    monkeypatch.setattr(train_mod, "grad_norm", nan_on_step_2)
    overrides = [o for o in tiny_overrides if not o.startswith("train.steps")]
    assert main(overrides + ["train.steps=3", "checkpoint.every=1"]) == 1
    err = capsys.readouterr().err
    assert "step 2: grad_norm nan; stopped before the update" in err
    ckpt = resolve(tmp_path / "run")
    assert ckpt.name == "step_1"
    model = build_model(load_config(None, overrides).model, "cpu")
    load_model_weights(ckpt, model)
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.quick
@pytest.mark.filterwarnings("ignore:CUDA is not available")  # a CUDA autocast made on a CPU machine
def test_precision_is_decided_once_from_the_recipe_the_device_and_the_layout():
    """precision.Precision.of, the one decision (its module docstring's table): bf16 compute on
    CUDA (train.dtype auto or bfloat16), float32 on CPU or with train.dtype=float32; the bf16 copy
    of every weight without FSDP, of the experts FSDP leaves out, of none under FSDP otherwise or
    in the bench's bf16 state; FSDP's policy and the state's bytes from the same value."""
    import torch

    from pithtrain.distributed.parallel_dims import ParallelDims
    from pithtrain.precision import Precision

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    one, sharded, alone = ParallelDims(), ParallelDims(fsdp=4, ep=2), ParallelDims(fsdp=2, ep=2)
    cfg = load_config(None, ["train.reduce_dtype=bfloat16"])
    want = [(cuda, one, torch.bfloat16, "all"), (cuda, sharded, torch.bfloat16, "none"),
            (cuda, alone, torch.bfloat16, "experts"), (cpu, one, torch.float32, "none"),
            (cpu, alone, torch.float32, "none")]
    for device, dims, compute, copy in want:
        p = Precision.of(cfg.train, device, dims)
        assert (p.compute, p.copy, p.copies is not None) == (compute, copy, copy != "none")
        assert p.fsdp_policy().param_dtype == compute and p.fsdp_policy().reduce_dtype == torch.bfloat16
        assert isinstance(p.autocast(), torch.autocast) == (compute == torch.bfloat16)
    assert Precision.of(load_config(None, ["train.dtype=float32"]).train, cuda, one).compute == torch.float32
    lean = Precision.of(cfg.train, cuda, one, state="bf16")
    assert lean.copies is None and lean.bytes_per_param() == {"weights": 2, "grads": 2, "optimizer": 4, "copy": 0}
    assert Precision.of(cfg.train, cuda, one).bytes_per_param() == {"weights": 4, "grads": 4, "optimizer": 8,
                                                                     "copy": 2}


@pytest.mark.quick
def test_bf16_copy_is_kept_and_follows_its_master():
    """precision.WeightCopies keeps one bf16 copy per float32 parameter across steps (tied
    parameters share it, its gradient hook registered once) and casts it again on entry whenever
    the master changed through torch since (here SGD's update), so each step computes with the
    current weights. (The cast skipped after kernels/adamw.py writes the copy: a GPU test.)"""
    import torch

    from pithtrain.precision import WeightCopies

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    model[1].weight = model[0].weight
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    copies, held = None, WeightCopies("all")
    for _ in range(3):
        with held.swap(model):
            ws = list(model.parameters())
            assert model[0].weight is model[1].weight and all(w.dtype == torch.bfloat16 for w in ws)
            for w in ws:
                assert torch.equal(w, held.master(w).detach().to(torch.bfloat16))
            copies = copies or ws
            assert all(a is b for a, b in zip(ws, copies))
            model(x).square().sum().backward()
        assert all(p.grad.dtype == torch.float32 for p in model.parameters())
        opt.step()
        opt.zero_grad()
    assert len(copies[0]._post_accumulate_grad_hooks) == 1


@pytest.mark.parametrize("in_place,tied", [(False, False), (True, False), (True, True)])
def test_bf16_step_weights_are_fsdps_numbers_without_fsdp(tiny_overrides, in_place, tied):
    """Under bf16 autocast without FSDP, train_step runs its micro-batches on one bf16 copy of the
    weights and accumulates each micro-batch's bf16 gradient in float32 (precision.WeightCopies):
    the reference is a pure-bf16 twin of the model whose per-micro-batch gradients are summed in
    float32 by hand (what FSDP's bf16 gathers and float32 reduction give). SGD at lr 1 with no clip
    makes the update the gradient itself; outside the step the modules hold the float32 masters.
    in_place: the embedding's and the LM head's gradients go straight into the masters' float32
    gradients (kernels/wgrad.py; the twin through autograd), the first micro-batch included; tied:
    both into one (tie_word_embeddings)."""
    import copy

    import torch

    from pithtrain.build import Run
    from pithtrain.distributed.parallel_dims import ParallelDims
    from pithtrain.models import build_model
    from pithtrain.models.common import set_aux_loss_scale
    from pithtrain.precision import Precision
    from pithtrain.train import train_step

    cfg = load_config(None, tiny_overrides + ["train.grad_accum=3", "train.grad_clip=0",
                                              f"model.tie_word_embeddings={str(tied).lower()}"])
    dims = ParallelDims.from_config(cfg, 1, 0)
    torch.manual_seed(0)
    model = build_model(cfg.model, torch.device("cpu"))
    twin = copy.deepcopy(model)
    for p in twin.parameters():  # parameters only: buffers (RoPE tables) stay float32, as in the step
        p.data = p.data.to(torch.bfloat16)
    set_aux_loss_scale(twin, 1 / 3)  # train_step sets the model's: 1 / its 3 micro-batches
    precision = Precision(torch.bfloat16, "cpu", copy="all")  # what Precision.of decides on one GPU
    if in_place:
        from pithtrain.kernels import NAMES
        from pithtrain.models.common import use_kernels

        use = {**dict.fromkeys(NAMES, False), "linear_ce": True}
        use_kernels(twin, use)
        use_kernels(model, {**use, "wgrad": True, "wgrad_ends": True}, precision.copies)
    g = torch.Generator().manual_seed(1)
    mbs = [(x, x.roll(-1, 1), None, None) for x in torch.randint(0, 250, (3, 4, 64), generator=g)]
    # in place, the LM head's dW / denom is float32 where the twin's autograd rounds it to bf16: a
    # power of two makes that exact; without, the tokens' count (not one)
    denom = 1024 if in_place else 3 * 4 * 64
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)

    want = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    rows = []  # in place, the embedding's reference: its output's bf16 gradient rows summed in float32
    if in_place:
        def keep_rows(module, inputs, out):
            out.register_hook(rows.append)

        twin.embed_tokens.register_forward_hook(keep_rows)
    for x, y, _, _ in mbs:
        with autocast:
            loss = twin(x, labels_BS=y)
        (loss / denom).backward()
        for n, p in twin.named_parameters():
            want[n] += p.grad.float()
            p.grad = None
    if in_place and not tied:  # the rows of each token added in float32, not each micro-batch's sum in bf16
        emb = torch.zeros_like(want["embed_tokens.weight"], dtype=torch.float64)
        for (x, _, _, _), dy in zip(mbs, rows):
            emb.index_add_(0, x.flatten(), dy.flatten(0, 1).double())
        want["embed_tokens.weight"] = emb.float()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    masters = {n: p for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    train_step(Run(cfg, dims, torch.device("cpu"), precision, {}, model, opt, sched), mbs, denom)
    for n, p in model.named_parameters():
        assert p is masters[n] and p.dtype == torch.float32, n
        if tied and n == "embed_tokens.weight":  # the twin rounds each micro-batch's head + embedding sum to
            d = before[n] - p.detach()             # bf16; here both parts add into float32: ~2^-9 apart
            assert (d - want[n]).norm() < 4e-3 * want[n].norm(), ((d - want[n]).norm() / want[n].norm())
            continue
        torch.testing.assert_close(before[n] - p.detach(), want[n], rtol=0, atol=1e-6, msg=lambda m: f"{n}: {m}")
    if in_place:  # written in place in each of the 3 micro-batches (the first: a new float32 gradient)
        assert model.embed_tokens.weight.wgrad_adds == (6 if tied else 3)
        assert tied == (model.lm_head.weight is model.embed_tokens.weight)
        if not tied:
            assert model.lm_head.weight.wgrad_adds == 3


def _init_from_fails_then_trains(rank: int, world: int, ports: list, tmp: str):
    """Each rank: train.init_from fails (a damaged checkpoint), then the same process trains (each
    train() its own rendezvous port: rank 1 must not reach rank 0's store of the run that ended)."""
    import os

    import torch
    import torch.distributed as dist

    from pithtrain.config import ConfigError, config_from_dict
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[0]))

    def cfg(hub):
        return config_from_dict({"train": dict(init_from=f"{tmp}/{hub}", steps=2, micro_batch_size=2, seq_len=16,
                                               warmup_steps=1, device="cpu"),
                                 "parallel": dict(fsdp=world), "data": dict(max_bytes=20000),
                                 "checkpoint": dict(final=False), "log": dict(run_dir=f"{tmp}/run")})
    out = {}
    try:
        train(cfg("bad"))
    except ConfigError as e:
        out["error"] = str(e)
    lock = os.path.realpath(f"{tmp}/run/.lock")
    out["group_left"] = dist.is_initialized()
    out["lock_open"] = any(os.path.realpath(f"/proc/self/fd/{fd}") == lock for fd in os.listdir("/proc/self/fd"))
    os.environ["MASTER_PORT"] = str(ports[1])
    out["steps"] = len(train(cfg("good"))[0])
    out["group_after"] = dist.is_initialized()
    with open(f"{tmp}/out{rank}.json", "w") as f:
        json.dump(out, f)


def test_a_failing_init_from_releases_the_lock_and_the_groups_then_the_process_trains(tmp_path):
    """Start-up under one ExitStack (train.train): whatever fails, the run lock and every process
    group start-up made are released, so the next train() in the same process (the skills' scripts
    import it) takes the lock, makes its own groups and plans its memory, on 2 gloo ranks."""
    import socket

    import torch

    from pithtrain.checkpoint.hf import save_hf
    from pithtrain.models import build_model
    cfg = load_config(None, ["model.num_layers=1", "model.hidden_size=32", "model.head_dim=8"])
    torch.manual_seed(0)
    for hub in ("bad", "good"):
        save_hf(build_model(cfg.model, "cpu"), tmp_path / hub)
    for f in (tmp_path / "bad").glob("*.safetensors"):
        f.write_bytes(f.read_bytes()[:20])  # a damaged copy: its header cut short
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    spawn(_init_from_fails_then_trains, args=(2, ports, str(tmp_path)), nprocs=2)
    for rank in range(2):
        out = json.loads((tmp_path / f"out{rank}.json").read_text())
        assert out["error"].startswith("train.init_from: ") and "\n" not in out["error"], out
        assert not out["group_left"] and not out["lock_open"], out
        assert out["steps"] == 2 and not out["group_after"], out


@pytest.mark.parametrize("given, want", [({}, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}),
                                         ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:256"},
                                          {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:256"}),
                                         ({"PYTORCH_ALLOC_CONF": "expandable_segments:False"},
                                          {"PYTORCH_ALLOC_CONF": "expandable_segments:False"})])
def test_a_cuda_run_takes_expandable_segments_unless_the_allocator_is_configured(monkeypatch, given, want):
    """On CUDA, before the device starts: expandable segments by default (the Qwen3 8 x H100
    emulation ran out of memory on fragmentation without them), the user's allocator options kept."""
    import os

    import torch

    from pithtrain import train as T
    for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(k, raising=False)
    for k, v in given.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert T.pick_device(load_config(None, ["train.device=cuda"])) == torch.device("cuda", 0)
    assert {k: os.environ[k] for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF") if k in os.environ} == want
    from pithtrain import bench  # `invoke bench` times the step with the allocator train runs it with

    class Built(Exception):
        pass

    def stop(*_):
        raise Built  # the allocator is set by now: nothing is built on the mocked GPU

    for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(k, raising=False)
    for k, v in given.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "a mocked GPU")
    monkeypatch.setattr(bench, "bench_config", stop)
    with pytest.raises(Built):
        bench.main(["--models", "qwen3-30b-a3b", "--peers", ""])
    assert {k: os.environ[k] for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF") if k in os.environ} == want
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert T.pick_device(load_config(None, ["train.device=auto"])) == torch.device("cpu")
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ  # a CPU run leaves it alone
