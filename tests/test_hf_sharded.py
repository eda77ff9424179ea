"""Sharded import of Hugging Face checkpoints (train.init_from, issue 20): each rank reads only
the slices it holds, under fsdp x ep and pp x fsdp, on 4 gloo processes.

One random checkpoint per family, ~150 MB in float32, written in 16 MB safetensors shards
(GPT-OSS with MXFP4 expert blocks, as published). The references: transformers' own model of
that checkpoint (logits) and a one-process load (every parameter slice, bit for bit).

Memory bound (asserted per rank and family): the growth of the peak resident set during the load
(VmHWM, reset through /proc/self/clear_refs before it) stays below half of the float32 model plus
SLACK_MB. A rank's shard is a quarter of the model here; SLACK_MB covers one file's mapped pages
(a 16 MB shard), one read slice and its converted copy, and allocator slack. Loading the whole
model on every rank, as train.init_from did before, needs the full float32 size and fails it.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import os
import socket
import time

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ranks import spawn  # noqa: E402

from pithtrain.checkpoint.hf import load_hf  # noqa: E402

SLACK_MB = 40
SHARD = "16MB"
FAMS = ("qwen3_moe", "deepseek_v2", "gpt_oss")
LAYOUTS = {"fsdp=2 x ep=2": dict(fsdp=4, ep=2), "pp=2 x fsdp=2": dict(pp=2, fsdp=2)}
PROBE = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))


def hf_config(family: str):
    common = dict(vocab_size=512, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                  max_position_embeddings=128)
    if family == "qwen3_moe":  # 8 layers of 16 experts: the largest tensor (12 MB) is 1/12 of the model
        return transformers.Qwen3MoeConfig(**{**common, "num_hidden_layers": 8}, intermediate_size=512,
                                           num_key_value_heads=2, head_dim=64, moe_intermediate_size=384,
                                           num_experts=16, num_experts_per_tok=2)
    if family == "deepseek_v2":
        return transformers.DeepseekV2Config(
            **common, intermediate_size=512, num_key_value_heads=4, kv_lora_rank=64, q_lora_rank=None,
            qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=32, num_experts_per_tok=2,
            n_shared_experts=1, moe_intermediate_size=384, first_k_dense_replace=1)
    return transformers.GptOssConfig(**common, intermediate_size=384, num_key_value_heads=2, head_dim=64,
                                     num_local_experts=32, num_experts_per_tok=2, sliding_window=8,
                                     layer_types=["sliding_attention", "full_attention"] * 2,
                                     attn_implementation="eager")


def write_shards(sd: dict, d, shard_bytes: int):
    """The hub layout transformers writes (model-0000i-of-0000n.safetensors + index)."""
    from safetensors.torch import save_file
    shards, cur, size = [], {}, 0
    for k, v in sd.items():
        cur[k] = v.contiguous()
        size += v.numel() * v.element_size()
        if size >= shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
    shards += [cur] if cur else []
    weight_map = {}
    for i, s in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(s, d / name, metadata={"format": "pt"})
        weight_map.update({k: name for k in s})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def make_hub(family: str, d):
    """A random checkpoint in `d`; returns transformers' model of it."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    torch.manual_seed(0)
    cfg = hf_config(family)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():  # HF zero-inits routers and biases: random ones make routing non-trivial
        for n, p in model.named_parameters():
            if "norm" not in n:
                p.normal_(0, 0.05)
    if family != "gpt_oss":
        model.save_pretrained(d, max_shard_size=SHARD)
        return model
    sd, gen = dict(model.state_dict()), torch.Generator().manual_seed(1)
    E, D, F_ = 32, cfg.hidden_size, cfg.intermediate_size
    for key in [k for k in sd if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        rows, cols = (2 * F_, D) if key.endswith("gate_up_proj") else (D, F_)
        blocks = torch.randint(0, 256, (E, rows, cols // 32, 16), dtype=torch.uint8, generator=gen)
        scales = torch.randint(118, 124, (E, rows, cols // 32), dtype=torch.uint8, generator=gen)
        del sd[key]
        sd[key + "_blocks"], sd[key + "_scales"] = blocks, scales
        with torch.no_grad():  # transformers' own model holds transformers' own dequantisation
            model.get_parameter(key).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    d.mkdir()
    cfg_json = cfg.to_dict()
    cfg_json.update(architectures=["GptOssForCausalLM"], quantization_config={"quant_method": "mxfp4"})
    (d / "config.json").write_text(json.dumps(cfg_json))
    write_shards(sd, d, 2 << 20)  # MXFP4: the experts take ~4 bits per weight on disk
    return model


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def hubs(tmp_path_factory):
    """Per family: the checkpoint, transformers' logits, and a one-process load (checked against
    transformers here; its parameters and logits are what every rank compares with)."""
    root = tmp_path_factory.mktemp("hubs")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # on a loaded 2-core machine two threads spin against each other
    for fam in FAMS:
        d = root / fam
        ref = make_hub(fam, d)
        with torch.no_grad():
            theirs = ref(PROBE).logits
        del ref
        one = load_hf(d).eval()
        with torch.no_grad():
            ours = one(PROBE)
        assert rel(ours, theirs) < 1e-5, fam
        torch.save({"params": dict(one.named_parameters()), "logits": ours, "hf_logits": theirs}, d / "one.pt")
        assert len(list(d.glob("*.safetensors"))) >= 6
    torch.set_num_threads(threads)
    return root


# ---------------------------------------------------------------------------------------------
# Workers


def _status(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _worker(rank: int, world: int, port: int, root: str):
    from pathlib import Path

    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from pithtrain.checkpoint.hf import load_hf_into
    from pithtrain.config import config_from_dict
    from pithtrain.distributed import pipeline
    from pithtrain.distributed.parallel_dims import ParallelDims
    from pithtrain.distributed.parallelize import parallelize
    from pithtrain.models import build_model
    from pithtrain.precision import Precision

    torch.set_num_threads(1)
    # A fixed mmap threshold (M_MMAP_THRESHOLD, -3): buffers over 1 MB are mapped and unmapped, not
    # kept in the heap, so one process measures the six loads as six fresh ones would.
    assert ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20) == 1
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    for layout, fam in itertools.product(LAYOUTS, FAMS):  # one launch for both layouts
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # an earlier load's freed heap would hide this one's
        d = Path(root) / fam
        cfg = config_from_dict({"train": dict(init_from=str(d), device="cpu", seq_len=16, grad_accum=2),
                                "parallel": LAYOUTS[layout]}, cross_checks=False)
        dims = ParallelDims.from_config(cfg)
        dims.init(torch.device("cpu"))
        model = build_model(cfg.model, init=False)
        if dims.pp_enabled:
            pipeline.prepare(model, cfg, dims)
        parallelize(model, dims, cfg.train, torch.device("cpu"), Precision())
        dist.barrier()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS now
        before, t0 = _status("VmRSS"), time.perf_counter()
        load_hf_into(model, d)
        seconds, peak = time.perf_counter() - t0, _status("VmHWM") - before
        ref = torch.load(d / "one.pt", mmap=True, weights_only=True)
        shard = 0
        for n, p in model.named_parameters():  # the same order on every rank of a stage
            local = p.to_local() if isinstance(p, DTensor) else p
            shard += local.numel() * local.element_size()
            assert torch.equal(p.full_tensor() if isinstance(p, DTensor) else p, ref["params"][n]), (fam, n)
        full = sum(p.numel() * 4 for p in ref["params"].values())
        rec = dict(peak=peak, seconds=seconds, shard=shard, full=full)
        if not dims.pp_enabled:  # every rank runs the sharded model on the same tokens
            with torch.no_grad():
                logits = model.eval()(PROBE)
            rec["rel_one"] = rel(logits, ref["logits"])
            rec["rel_hf"] = rel(logits, ref["hf_logits"])
        Path(root, f"{layout}.{fam}.{rank}.json").write_text(json.dumps(rec))
        del model, ref
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sharded_import_reads_only_its_slices(hubs):
    spawn(_worker, args=(4, free_port(), str(hubs)), nprocs=4)
    for layout, rank, fam in itertools.product(LAYOUTS, range(4), FAMS):
        r = json.loads((hubs / f"{layout}.{fam}.{rank}.json").read_text())
        mb = {k: r[k] / 2 ** 20 for k in ("peak", "shard", "full")}
        print(f"{layout} rank {rank} {fam}: peak +{mb['peak']:.0f} MB (shard {mb['shard']:.0f} MB, "
              f"full fp32 {mb['full']:.0f} MB), {r['seconds']:.2f} s")
        assert mb["peak"] < mb["full"] / 2 + SLACK_MB, (layout, rank, fam, mb)
        if "rel_one" in r:  # EP sums a token's experts in another order: float32 rounding only
            assert r["rel_one"] < 1e-5 and r["rel_hf"] < 1e-5, (layout, rank, fam, r)


# ---------------------------------------------------------------------------------------------
# Streaming export of a training checkpoint of that model


def test_export_streams_shard_by_shard_with_tokenizer(hubs, tmp_path):
    """A training checkpoint of the imported Qwen3 model (one step at lr 1e-30: the hub's weights
    to the bit, on token shards prepared with a tokenizer) exports in a fresh process whose peak
    resident memory grows by less than 3 of the largest float32 tensor + SLACK_MB (DCP reads a
    tensor's bytes, then copies them; then its converted copy), whatever the shard size: under
    half the float32 model here. transformers loads the export and gives the original
    checkpoint's logits; the tokenizer came along."""
    import subprocess
    import sys

    import numpy as np
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from pithtrain.config import load_config
    from pithtrain.train import train

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(["hello world, this is pithtrain"] * 50,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<|endoftext|>"]))
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    data = tmp_path / "data"
    data.mkdir()
    tok.save(str(data / "tokenizer.json"))  # beside the shards, as prepare-data keeps it: checkpoints carry it
    np.random.default_rng(0).integers(0, 300, 5000).astype(np.uint16).tofile(data / "shard_00000.bin")
    (data / "meta.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": 300,
                                                "tokenizer": str(tmp_path / "tok"),
                                                "files": [{"name": "shard_00000.bin", "tokens": 5000}]}))
    run = tmp_path / "run"
    train(load_config(None, [f"train.init_from={hubs / 'qwen3_moe'}", "train.lr=1e-30", "train.steps=1",
                             "train.seq_len=16", "train.micro_batch_size=1", "train.warmup_steps=1",
                             "train.device=cpu", "data.source=shards", f"data.path={data}",
                             f"log.run_dir={run}"]), resume=False)
    code = ("import sys\nfrom pithtrain.checkpoint.export import main\n"
            "st = lambda f: next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith(f + ':'))\n"
            "base = st('VmRSS'); rc = main(sys.argv[1:]); print('MEM', base, st('VmHWM')); sys.exit(rc)")
    shard_mb = 16
    out = subprocess.run([sys.executable, "-c", code, "--ckpt", str(run), "--out", str(tmp_path / "hf"),
                          "--dtype", "float32", "--shard-mb", str(shard_mb)], capture_output=True, text=True,
                         timeout=300,  # freed buffers go back to the system, as tensors over glibc's
                         env={**os.environ, "OMP_NUM_THREADS": "1",  # 32 MB dynamic limit always do
                              "MALLOC_MMAP_THRESHOLD_": str(1 << 20)})
    assert out.returncode == 0, out.stderr[-3000:]
    base, hwm = map(int, out.stdout.split("MEM ")[1].split())
    ref = torch.load(hubs / "qwen3_moe" / "one.pt", mmap=True, weights_only=True)
    largest = max(p.numel() * 4 for p in ref["params"].values()) / 2 ** 20
    full = sum(p.numel() * 4 for p in ref["params"].values()) / 2 ** 20
    grew = (hwm - base) / 1024
    print(f"export: peak +{grew:.0f} MB (shards {shard_mb} MB, largest tensor {largest:.0f} MB, "
          f"full fp32 {full:.0f} MB)")
    assert grew < 3 * largest + SLACK_MB < full / 2 + SLACK_MB, (grew, largest)
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) >= 8
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (tmp_path / "tok" / "tokenizer.json").read_bytes()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").float().eval()
    with torch.no_grad():
        assert rel(theirs(PROBE).logits, ref["hf_logits"]) < 1e-6


# ---------------------------------------------------------------------------------------------
# GPU (the lent H200: `pytest -m gpu tests/test_hf_sharded.py`)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fam", FAMS)
def test_import_onto_the_gpu_allocates_the_model_once(tmp_path, fam):
    """One GPU: the device holds the float32 model and nothing more than one read piece besides
    (the old path built the model on the GPU and then copied each whole tensor there). The peak
    is counted from what was allocated before the import: the first GPU matmul of the process
    keeps cuBLAS's workspace (32 MB on Hopper) allocated for good."""
    from pithtrain.checkpoint.hf import READ_BYTES, load_hf_into
    from pithtrain.models import build_model, read_config

    ref = make_hub(fam, tmp_path / "hub")
    with torch.no_grad():
        theirs = ref(PROBE).logits
    model = build_model(read_config(tmp_path / "hub")[1], init=False)
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    load_hf_into(model, tmp_path / "hub", "cuda")
    size = sum(p.numel() * 4 for p in model.parameters()) + sum(b.numel() * b.element_size() for b in model.buffers())
    peak = torch.cuda.max_memory_allocated() - before
    print(f"{fam}: GPU peak {peak / 2 ** 20:.0f} MB for a {size / 2 ** 20:.0f} MB model "
          f"({before / 2 ** 20:.0f} MB before)")
    assert peak < size + 2 * READ_BYTES + (8 << 20)
    with torch.no_grad():
        assert rel(model.eval()(PROBE.cuda()).cpu(), theirs) < 1e-4
