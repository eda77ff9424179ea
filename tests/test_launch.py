"""How `invoke train` / `invoke launch` start the trainer natively (inside the image, or without
Docker): how many processes and why, the recipe checked once before torchrun starts them, and
the way a mistake or a Ctrl-C during start-up ends (one line, the trainer's exit code)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from invoke import Context
from invoke.exceptions import Exit

import tasks
from pithtrain import train as trainer

ROOT = Path(__file__).resolve().parent.parent
MULTINODE = {"MASTER_ADDR": "node0", "MASTER_PORT": "29500", "NNODES": "2", "NODE_RANK": "0"}


@pytest.fixture
def native(monkeypatch):
    """tasks.py inside the image (the runtime is native), on a machine whose GPU count a test sets;
    returns the shell lines the task ran (Popen is recorded, not run)."""
    monkeypatch.setenv("PITHTRAIN_TARGET", "hopper")
    started = []

    class Done:
        def __init__(self, argv, **_):
            started.append(argv[-1])

        def wait(self):
            return 0

    monkeypatch.setattr(tasks.subprocess, "Popen", Done)
    return started


def gpus(monkeypatch, n: int):
    monkeypatch.setattr(tasks, "_visible_gpus", lambda: n)


@pytest.mark.quick
def test_gpu_natively_starts_one_process_per_visible_gpu_and_says_why(native, monkeypatch, capsys):
    """The design card's command inside the image: every GPU, as the docker path's torchrun does."""
    checked = []
    monkeypatch.setattr(tasks, "_check_recipe", lambda args, world: checked.append((args, world)))
    gpus(monkeypatch, 8)
    tasks.train(Context(), gpu="h200", model="gpt-oss-20b")
    assert native == [f"{sys.executable} -m tools.appliance torchrun --nproc-per-node=8 --standalone -m "
                      "pithtrain.train gpt-oss-20b train.device=cuda train.dtype=bfloat16"]
    assert checked == [(["gpt-oss-20b", "train.device=cuda", "train.dtype=bfloat16"], 8)]
    assert capsys.readouterr().err.splitlines()[0] == (
        "invoke: 8 processes (--gpu=h200: one per visible GPU; --nproc=N for fewer)")
    # one GPU visible, or --nproc 1: the plain one-process command, no torchrun, nothing to check first
    for n, nproc, why in [(1, "", "--gpu=h200: 1 GPU visible"), (8, "1", "--nproc=1")]:
        native.clear()
        gpus(monkeypatch, n)
        tasks.train(Context(), gpu="h200", nproc=nproc)
        assert native == [f"{sys.executable} -m pithtrain.train train.device=cuda train.dtype=bfloat16"]
        assert capsys.readouterr().err == f"invoke: 1 process ({why})\n"
    assert len(checked) == 1
    # without --gpu nothing is chosen or said: the Quick start's command, exactly
    native.clear()
    tasks.train(Context())
    assert native == [f"{sys.executable} -m pithtrain.train"] and capsys.readouterr().err == ""


@pytest.mark.quick
def test_docker_missing_runs_natively_on_every_gpu(native, monkeypatch, capsys):
    monkeypatch.delenv("PITHTRAIN_TARGET")
    monkeypatch.setattr(tasks, "_docker_problem", lambda: "docker not found")
    monkeypatch.setattr(tasks, "_check_recipe", lambda args, world: None)
    gpus(monkeypatch, 4)
    tasks.train(Context(), gpu="h100")
    assert native[0].startswith(f"{sys.executable} -m tools.appliance torchrun --nproc-per-node=4 --standalone ")
    err = capsys.readouterr().err
    assert "docker not found: running natively" in err and "invoke: 4 processes (--gpu=h100: one per" in err


@pytest.mark.quick
def test_a_recipe_mistake_stops_before_torchrun_once_with_exit_2(native, capsys):
    """The parent resolves the recipe and checks the layout against the world size: one line, no
    torchrun started (whose ranks would each print it)."""
    for nproc, bad, said in [("4", "parallel.fsdp=3", "pp*dp*fsdp*cp = 1*1*3*1 = 3 but 4 processes"),
                             ("2", "train.lr=fast", "train.lr: expected a number, got 'fast'")]:
        with pytest.raises(Exit) as e:
            tasks.train(Context(), nproc=nproc, set=[bad])
        assert e.value.code == 2 and native == []
        err = capsys.readouterr().err.splitlines()
        assert err[0] == f"invoke: {nproc} processes (--nproc={nproc})"
        assert len(err) == 2 and err[1].startswith("error: ") and said in err[1]
    # parallel: auto is resolved for the world it will have (here 4 processes: a valid layout)
    tasks.train(Context(), nproc="4", set=["parallel.auto=true"])
    assert native == [f"{sys.executable} -m tools.appliance torchrun --nproc-per-node=4 --standalone -m "
                      "pithtrain.train parallel.auto=true"]


@pytest.mark.quick
def test_launch_checks_the_recipe_for_every_node(native, monkeypatch, capsys):
    for k, v in MULTINODE.items():
        monkeypatch.setenv(k, v)
    gpus(monkeypatch, 2)  # compose's command: every GPU of the node, 2 nodes -> 4 processes
    with pytest.raises(Exit) as e:
        tasks.launch(Context(), runtime="native", set=["parallel.fsdp=2"])
    assert e.value.code == 2 and native == []
    assert "but 4 processes were started" in capsys.readouterr().err
    tasks.launch(Context(), runtime="native", set=["parallel.fsdp=4"])
    assert native[0].startswith(f"{sys.executable} -m tools.appliance torchrun --nproc-per-node=gpu --nnodes=2 ")


def test_ctrl_c_before_torchrun_starts_is_one_line(native, monkeypatch, capsys):
    def interrupted(args, world):
        raise KeyboardInterrupt

    monkeypatch.setattr(tasks, "_check_recipe", interrupted)
    with pytest.raises(Exit) as e:
        tasks.train(Context(), nproc="2")
    assert e.value.code == 130 and native == []
    assert e.value.message == "invoke: stopped by SIGINT before the trainer started; nothing saved"


@pytest.mark.quick
def test_only_rank_0_prints_a_config_error(monkeypatch, capsys):
    """Every rank meets the same error: rank 0 says it at once; another rank waits, and says it only
    when torchrun has not ended it by then (an error of its own)."""
    waited = []
    monkeypatch.setattr(trainer.time, "sleep", waited.append)
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        assert trainer.main(["train.lr=fast"]) == 2
        err = capsys.readouterr().err
        assert err == ("error: " if rank == "0" else "error: rank 1: ") + (
            "command-line override 'train.lr=fast': train.lr: expected a number, got 'fast'\n")
    assert waited == [0, 5]  # rank 0 does not wait
    monkeypatch.setenv("RANK", "0")
    assert trainer.main(["--check", "2", "parallel.fsdp=2"]) == 0 and capsys.readouterr() == ("", "")


@pytest.mark.quick
def test_the_parents_check_refuses_evaluation_under_pp_naming_only_its_key(capsys):
    """The launcher's check before torchrun (train.py --check: build.check_run without a device)
    refuses evaluation under pp > 1 in one line naming train.eval_every; the unrelated override
    (train.lr) is not named."""
    assert trainer.main(["--check", "2", "parallel.pp=2", "train.eval_every=2", "train.lr=1e-3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "train.lr" not in err
    assert err.endswith("default.yaml: train.eval_every: evaluation is not supported with parallel.pp > 1 "
                        "(set train.eval_every=0)\n")


def test_plan_refusal_names_nproc(capsys):
    from pithtrain.plan import main as plan

    assert plan(["--model", "deepseek-v2-lite", "--gpu", "h100", "--gpus", "1"]) == 1
    assert "more GPUs than 1 (invoke train --nproc N: one process per GPU)" in capsys.readouterr().err


def _maps(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return ""


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc to see the imports under way")
def test_ctrl_c_while_the_trainer_imports_is_one_line(tmp_path):
    """A Ctrl-C in the first seconds lands in the imports (torch's): one line and 130, not their
    traceback. The signal is sent once torch's library is being loaded."""
    p = subprocess.Popen([sys.executable, "-m", "pithtrain.train", f"log.run_dir={tmp_path}"], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while "libtorch" not in _maps(p.pid) and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130, out + err
    assert err == "pithtrain: stopped by SIGINT before training began; nothing saved\n", out + err


def test_a_rank_side_config_error_through_torchrun_is_one_line_and_exit_2(tmp_path):
    """What the parent cannot see (here FP8 on CPU, refused by the ranks; on a GPU the memory plan):
    rank 0 says it once; torchrun ends with its code, without its traceback and failure table."""
    env = {k: v for k, v in os.environ.items() if k not in ("PITHTRAIN_TARGET", "RANK", "WORLD_SIZE")}
    r = subprocess.run([sys.executable, "-m", "invoke", "train", "--nproc=2", "--set=parallel.fsdp=2",
                        "--set=train.fp8=true", f"--set=log.run_dir={tmp_path}"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    errors = [line for line in r.stderr.splitlines() if "error:" in line.lower()]
    assert errors == ["error: recipes/default.yaml: train.fp8: FP8 training needs a Hopper or Blackwell GPU; "
                      "this run is on CPU (set train.fp8=false)".replace("recipes/", f"{ROOT}/pithtrain/recipes/")]
    assert "Traceback" not in r.stderr and "ChildFailedError" not in r.stderr
