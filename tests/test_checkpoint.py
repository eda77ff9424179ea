"""Checkpoints: exact resume, crash safety, damaged files named, safe loading, Hugging Face export.

One reference run (20 steps, a checkpoint every 5) is shared by most tests; each test that damages
or extends checkpoints works on a copy."""

import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import variant
from ranks import spawn

from pithtrain.build import build_optimizer, lr_lambda
from pithtrain.checkpoint.dcp import Checkpointer, CheckpointError, SafeReader, resolve, verify
from pithtrain.config import load_config
from pithtrain.data import TokenBatches
from pithtrain.models import build_model
from pithtrain.train import main, train

# conftest.tiny_overrides without the run dir, for the module-scoped reference run
TINY = ["train.micro_batch_size=4", "train.seq_len=64", "train.warmup_steps=5",
        "model.hidden_size=64", "model.num_heads=4", "model.head_dim=16",
        "model.moe_intermediate_size=64", "model.num_layers=2", "data.max_bytes=300000"]
RUN = TINY + ["train.steps=20", "checkpoint.every=5", "checkpoint.keep_last=3", "log.every=1"]


def cfg_for(run_dir, *extra):
    return load_config(None, RUN + variant.overrides([*RUN, *extra]) + [f"log.run_dir={run_dir}", *extra])


def losses(run_dir) -> dict[int, float]:
    """step -> loss from metrics.jsonl (a resumed run continues it from its resume point, so
    each step appears once)."""
    recs = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in recs]
    assert steps == sorted(set(steps)), steps
    return {r["step"]: r["loss"] for r in recs}


def restored(ckpt, run_dir):
    """(model state, optimizer state) as a fresh process would restore them from `ckpt`."""
    cfg = cfg_for(run_dir)
    model = build_model(cfg.model, "cpu")
    opt = build_optimizer(model, cfg, torch.device("cpu"))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    step = Checkpointer(cfg, model, opt, sched, torch.device("cpu")).load(Path(ckpt))
    return step, model.state_dict(), opt.state_dict()["state"], sched.state_dict()


def assert_same(a, b):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    else:
        assert a == b


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """20 steps straight; checkpoints at 5, 10, 15, 20 (keep_last 3: 10, 15, 20 remain)."""
    run = tmp_path_factory.mktemp("ref") / "run"
    hist, model = train(cfg_for(run))
    assert [h["step"] for h in hist] == list(range(1, 21))
    return run


def copy_run(ref, tmp_path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(ref, dst)
    return dst


# ---------------------------------------------------------------------------------------------
# Exact resume


class Preempted(Exception):
    pass


@pytest.mark.quick
def test_resume_is_bit_exact(ref, tmp_path, monkeypatch, capsys):
    """10 steps, a crash, a resume, 10 more == 20 straight: every loss and the final parameters,
    optimizer moments and LR schedule, bit for bit (float32, CPU)."""
    run = tmp_path / "run"
    real_batch = TokenBatches.batch

    def batch_until_10(self, step):
        if step == 10:  # after step 10 was trained and checkpointed
            raise Preempted
        return real_batch(self, step)

    monkeypatch.setattr(TokenBatches, "batch", batch_until_10)
    with pytest.raises(Preempted):
        train(cfg_for(run))
    monkeypatch.setattr(TokenBatches, "batch", real_batch)
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_10"
    hist, _ = train(cfg_for(run))  # no flag: resumes by itself
    assert "resumed from" in capsys.readouterr().out
    assert [h["step"] for h in hist] == list(range(11, 21))

    assert losses(run) == losses(ref)  # every step, exact float equality
    a, b = restored(run / "checkpoints/step_20", run), restored(ref / "checkpoints/step_20", ref)
    assert a[0] == b[0] == 20
    assert_same(a[1:], b[1:])


def test_resume_restores_rng_and_reports_nothing_left(ref, tmp_path, capsys):
    run = copy_run(ref, tmp_path)
    torch.manual_seed(0)
    assert train(cfg_for(run))[0] == []  # already at step 20 of 20
    out = capsys.readouterr().out
    assert "resumed from" in out and "step_20" in out and "nothing left to train" in out
    # loading restores exactly the RNG state the saving process had, not the current one
    cfg = cfg_for(tmp_path / "rng", "train.steps=1")
    model = build_model(cfg.model, "cpu")
    opt = build_optimizer(model, cfg, torch.device("cpu"))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    ck = Checkpointer(cfg, model, opt, sched, torch.device("cpu"))
    torch.manual_seed(77)
    torch.rand(5)  # a state no seed call produces directly
    at_save = torch.get_rng_state()
    ck.save(1)
    torch.manual_seed(0)
    ck.load(tmp_path / "rng" / "checkpoints" / "step_1")
    assert torch.equal(torch.get_rng_state(), at_save)


def test_resume_takes_the_recipes_optimizer_settings(ref, tmp_path):
    """A changed lr / weight decay / betas applies from the resumed step on (the recipe is the
    whole truth of a run); moments and step counts come from the checkpoint."""
    cfg = cfg_for(tmp_path, "train.lr=1e-4", "train.weight_decay=0.5", "train.beta2=0.99")
    model = build_model(cfg.model, "cpu")
    opt = build_optimizer(model, cfg, torch.device("cpu"))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    assert Checkpointer(cfg, model, opt, sched, torch.device("cpu")).load(ref / "checkpoints/step_15") == 15
    want_lr = 1e-4 * lr_lambda(cfg)(15)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.5, 0.0]
    assert [g["betas"] for g in opt.param_groups] == [(0.9, 0.99)] * 2
    assert [g["initial_lr"] for g in opt.param_groups] == sched.base_lrs == [1e-4, 1e-4]
    assert [g["lr"] for g in opt.param_groups] == sched.get_last_lr() == [want_lr, want_lr]
    assert sched.last_epoch == 15
    saved = restored(ref / "checkpoints/step_15", ref)[2]
    assert_same(opt.state_dict()["state"], saved)  # moments and step counts as saved


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, on purpose
def test_async_save_snapshots_state(tmp_path):
    """The CUDA path (dcp.async_save + commit thread), exercised on CPU: the checkpoint holds the
    state at save time even though training changes the parameters while it is written."""
    cfg = cfg_for(tmp_path / "run", "train.steps=3")
    model = build_model(cfg.model, "cpu")
    opt = build_optimizer(model, cfg, torch.device("cpu"))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    ck = Checkpointer(cfg, model, opt, sched, torch.device("cpu"))
    ck.use_async = True
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ck.save(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ck.close()
    assert (tmp_path / "run/checkpoints/latest").read_text().strip() == "step_3"
    _, state, _, _ = restored(tmp_path / "run/checkpoints/step_3", tmp_path / "run")
    assert_same(state, before)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_async_save_with_a_background_copy_holds_the_state_before_the_next_optimizer_step(tmp_path, monkeypatch):
    """A stager that copies the state in the background (DCP then answers staging and upload
    futures, and only the upload's was kept): the optimizer step waits for the copy, so the
    checkpoint holds the state the save was asked for, not the next step's."""
    import concurrent.futures
    import threading

    from pithtrain.checkpoint import dcp as dcp_mod

    class LateCopy(dcp_mod.FileSystemWriter):
        def stage(self, state_dict):
            done, copy = concurrent.futures.Future(), super().stage

            def later():
                time.sleep(0.5)
                done.set_result(copy(state_dict))
            threading.Thread(target=later).start()
            return done

    monkeypatch.setattr(dcp_mod, "FileSystemWriter", LateCopy)
    cfg = cfg_for(tmp_path / "run", "train.steps=3")
    model = build_model(cfg.model, "cpu")
    opt = build_optimizer(model, cfg, torch.device("cpu"))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    ck = Checkpointer(cfg, model, opt, sched, torch.device("cpu"))
    ck.use_async = True
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ck.save(3)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    ck.close()
    _, state, _, _ = restored(tmp_path / "run/checkpoints/step_3", tmp_path / "run")
    assert_same(state, before)
    assert not all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # the step moved them


# ---------------------------------------------------------------------------------------------
# Faults: SIGKILL mid-run, death inside a save, damaged files


# one intra-op thread in subprocesses: on 2 shared cores, two spinning OpenMP threads per process
# only slow everything down
SUB_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def train_cmd(run, *extra):
    overrides = TINY + variant.overrides([*TINY, *extra]) + [f"log.run_dir={run}", "log.every=1", *extra]
    return [sys.executable, "-m", "pithtrain.train", *overrides]


@pytest.mark.quick
def test_a_notice_is_recorded_and_the_old_handler_restored():
    """pithtrain/reliability.py's Notice, which train.py turns into a save and an exit at the next
    step boundary (tests/test_reliability.py, end to end): the first SIGUSR1 is recorded, not acted
    on at once; close() puts the previous handler back."""
    import threading

    from pithtrain.reliability import Notice
    assert threading.current_thread() is threading.main_thread()  # signal handlers live there
    before = signal.getsignal(signal.SIGUSR1)
    notice = Notice(["SIGUSR1"])
    os.kill(os.getpid(), signal.SIGUSR1)
    assert notice.signum == signal.SIGUSR1
    notice.close()
    assert signal.getsignal(signal.SIGUSR1) is before


def test_sigkill_mid_run_resumes_from_last_checkpoint(tmp_path):
    run = tmp_path / "run"
    extra = ["train.steps=10", "checkpoint.every=2"]
    proc = subprocess.Popen(train_cmd(run, *extra), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env=SUB_ENV)
    latest, deadline = run / "checkpoints" / "latest", time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if latest.is_file() and int(latest.read_text().strip().removeprefix("step_")) >= 4:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)  # no chance to clean up: may land inside a save
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
    killed = losses(run)

    out = subprocess.run(train_cmd(run, *extra), capture_output=True, text=True, timeout=180, env=SUB_ENV)
    assert out.returncode == 0, out.stderr[-2000:]
    first = int(re.search(r"resumed from \S+ at step (\d+)", out.stdout).group(1))
    assert first >= 4 and f"step {first + 1:6d} |" in out.stdout
    redone = losses(run)
    assert sorted(redone) == list(range(1, 11))
    assert all(redone[s] == killed[s] for s in killed)  # steps the killed run logged, trained again
    # every step equals an uninterrupted run of the same command (the kill may land anywhere)
    straight = subprocess.run(train_cmd(tmp_path / "straight", *extra), capture_output=True, text=True,
                              timeout=180, env=SUB_ENV)
    assert straight.returncode == 0, straight.stderr[-2000:]
    assert redone == losses(tmp_path / "straight")


ASYNC_THEN_FAIL = """
import sys, time
from pithtrain.checkpoint import dcp
from pithtrain.data import TokenBatches
from pithtrain.train import main
init, manifest, batch = dcp.Checkpointer.__init__, dcp.write_manifest, TokenBatches.batch

def async_init(self, *args):  # the CUDA path (dcp.async_save + a daemon commit thread), on CPU
    init(self, *args)
    self.use_async = True

def slow_manifest(*args):  # the commit is still running when the error comes
    time.sleep(2)
    manifest(*args)

def batch_until_2(self, step):
    if step == 2:
        raise RuntimeError("the node went away")
    return batch(self, step)

dcp.Checkpointer.__init__, dcp.write_manifest, TokenBatches.batch = async_init, slow_manifest, batch_until_2
sys.exit(main(sys.argv[1:]))
"""


def test_a_failing_run_still_commits_the_asynchronous_save_in_flight(tmp_path):
    """Step 2's checkpoint is being written asynchronously when step 3 fails: the process stops
    with the error, but only after that checkpoint is committed (its daemon thread would die)."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-c", ASYNC_THEN_FAIL, *train_cmd(run, "train.steps=6", "checkpoint.every=2")[3:]]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=SUB_ENV)
    assert out.returncode == 1 and "the node went away" in out.stderr, out.stderr[-2000:]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_2"
    assert verify(run / "checkpoints" / "step_2")["step"] == 2


def test_death_inside_save_keeps_previous_checkpoint(tmp_path, capsys):
    run = tmp_path / "run"
    env = {**SUB_ENV, "PITHTRAIN_TEST_CRASH_IN_SAVE": "4"}
    out = subprocess.run(train_cmd(run, "train.steps=6", "checkpoint.every=2"), env=env,
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 70, out.stderr[-2000:]
    ck = run / "checkpoints"
    assert (ck / "latest").read_text().strip() == "step_2"
    assert (ck / ".tmp-step_4" / ".metadata").is_file() and not (ck / "step_4").exists()
    verify(ck / "step_2")
    hist, _ = train(cfg_for(run, "train.steps=6", "checkpoint.every=2"))
    said = capsys.readouterr().out
    assert "ignoring .tmp-step_4: a save that did not finish" in said
    assert "resumed from" in said and "step_2 at step 2" in said
    assert [h["step"] for h in hist] == list(range(3, 7))
    assert "removed .tmp-step_4" in said
    assert not (ck / ".tmp-step_4").exists() and (ck / "step_4").is_dir()


SAVE_AGAIN = """
import os, sys
from pathlib import Path
import torch
from pithtrain.checkpoint import dcp
from pithtrain.config import load_config
from pithtrain.models import build_model
from pithtrain.build import build_optimizer, lr_lambda
rename = os.rename

def die_between(src, dst):  # a second save of a step: the old one set aside, then killed
    rename(src, dst)
    if Path(dst).name.startswith(".replaced-"):
        os._exit(70)

os.rename = die_between
cfg = load_config(None, sys.argv[2:])
model = build_model(cfg.model, "cpu")
opt = build_optimizer(model, cfg, torch.device("cpu"))
sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
dcp.Checkpointer(cfg, model, opt, sched, torch.device("cpu")).save(int(sys.argv[1]))
"""


def test_a_death_between_the_two_renames_of_a_second_save_resumes_from_the_previous_one(ref, tmp_path, capsys):
    """Saving step 20 again renames step_20 `.replaced-step_20`, then the new save's directory
    step_20: a process killed in between leaves no step_20. Resume takes `.replaced-step_20` back
    (complete: it verifies), says so, and restores exactly the first save of step 20."""
    run = copy_run(ref, tmp_path)
    args = RUN + variant.overrides() + [f"log.run_dir={run}"]
    p = subprocess.run([sys.executable, "-c", SAVE_AGAIN, "20", *args], capture_output=True, text=True,
                       timeout=180, env=SUB_ENV)
    ck = run / "checkpoints"
    assert p.returncode == 70, p.stderr[-2000:]
    assert not (ck / "step_20").exists() and (ck / ".replaced-step_20").is_dir() and (ck / ".tmp-step_20").is_dir()
    train(cfg_for(run))
    said = capsys.readouterr().out
    assert ("restored .replaced-step_20 -> step_20: the process stopped while step 20 was saved again, and this "
            "is its previous save") in said
    assert f"resumed from {ck / 'step_20'} at step 20" in said and "removed .tmp-step_20" in said
    assert (ck / "latest").read_text().strip() == "step_20" and not (ck / ".replaced-step_20").exists()
    assert_same(restored(ck / "step_20", run), restored(ref / "checkpoints" / "step_20", ref))
    # a death after the second rename leaves a `.replaced-step_20` beside step_20: removed at the next
    # resume; one newer than the resume point is set aside as a newer step_N is
    for leftover in (".replaced-step_20", ".replaced-step_25"):
        shutil.copytree(ck / "step_20", ck / leftover)
    cfg = cfg_for(run)
    model = build_model(cfg.model, "cpu")
    opt = build_optimizer(model, cfg, torch.device("cpu"))
    Checkpointer(cfg, model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg)), torch.device("cpu"))._tidy(20)
    said = capsys.readouterr().out
    assert "removed .replaced-step_20 (step_20 replaced it)" in said
    assert "set aside .replaced-step_25 -> .abandoned-.replaced-step_25 (newer than the resume point, step 20)" in said
    assert sorted(p.name for p in ck.iterdir() if p.name.startswith(".")) == [".abandoned-.replaced-step_25"]


def damage(path: Path, how: str):
    data = bytearray(path.read_bytes())
    if how == "corrupt":
        data[len(data) // 2] ^= 0xFF
    else:
        data = data[: len(data) // 2]
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how,word", [("corrupt", "sha256"), ("truncate", "truncated")])
def test_damaged_shard_is_named(ref, tmp_path, capsys, how, word):
    run = copy_run(ref, tmp_path)
    ck = run / "checkpoints"
    shard = ck / "step_20" / "__0_0.distcp"
    damage(shard, how)
    with pytest.raises(CheckpointError, match=word) as e:
        verify(ck / "step_20")
    assert str(shard) in str(e.value)
    # asked for by name: an error naming the file, through the command line too
    assert main(RUN + variant.overrides(RUN) + [f"log.run_dir={tmp_path / 'other'}", f"--resume={ck / 'step_20'}"]) == 2
    assert str(shard) in capsys.readouterr().err
    # automatic resume: skips it out loud, falls back to step_15, sets the damaged one aside
    hist, _ = train(cfg_for(run))
    said = capsys.readouterr().out
    assert f"skipping step_20: {shard}" in said and "step_15 at step 15" in said
    assert "set aside step_20 -> .abandoned-step_20" in said
    assert [h["step"] for h in hist] == list(range(16, 21))
    assert losses(run) == losses(ref)
    assert (ck / ".abandoned-step_20").is_dir() and verify(ck / "step_20")


def test_resume_from_an_older_step_repoints_latest(ref, tmp_path, capsys):
    """--resume step_10 sets step_15 / step_20 aside and points `latest` at step_10, so the next
    automatic resume finds no gap between the pointer and the newest checkpoint."""
    run = copy_run(ref, tmp_path)
    ck = run / "checkpoints"
    assert train(cfg_for(run, "train.steps=10"), resume=str(ck / "step_10"))[0] == []
    assert (ck / "latest").read_text().strip() == "step_10"
    capsys.readouterr()
    assert train(cfg_for(run, "train.steps=10"))[0] == []
    said = capsys.readouterr().out
    assert "resumed from" in said and "step_10" in said and "is newer" not in said


def test_hashing_a_large_checkpoint_shows_progress(capsys):
    from pithtrain.checkpoint.dcp import _progress
    done = _progress(Path("step_7"), "verifying", 3_000_000_000, every_s=0)
    done(1_000_000_000)
    done(2_000_000_000)  # finished: no line, the caller says what comes next
    assert capsys.readouterr().out == "checkpoint: verifying step_7: 1.0 of 3.0 GB hashed (0 s)\n"


def test_no_valid_checkpoint_is_an_error_not_a_fresh_start(ref, tmp_path, capsys):
    run = copy_run(ref, tmp_path)
    for d in ("step_10", "step_15", "step_20"):
        damage(run / "checkpoints" / d / "trainer.json", "corrupt")
    assert main(RUN + variant.overrides(RUN) + [f"log.run_dir={run}"]) == 2
    err = capsys.readouterr().err
    assert "none is valid" in err and all(f"skipping {d}" in err for d in ("step_10", "step_20"))
    assert "none is valid (start fresh with --no-resume" in err.splitlines()[0]  # the way out, first


def test_resume_refusals_name_the_way_out_first_on_one_line(ref, tmp_path, monkeypatch, capsys):
    """The data walkthrough's trap (issue 50): a run dir trained on another tokenizer and another
    model. The refusal is the model's (following a tokenizer hint would only meet it next), and
    each refusal names --no-resume and another log.run_dir before any other way, on one line."""
    from pithtrain.checkpoint import dcp as dcp_mod

    run = copy_run(ref, tmp_path)
    real = dcp_mod.tokenizer_of
    monkeypatch.setattr(dcp_mod, "tokenizer_of", lambda data: {**real(data), "tokenizer_sha256": "f" * 64})
    fresh = "start fresh with --no-resume (it sets the checkpoints aside) or choose another log.run_dir"
    assert main(RUN + variant.overrides() + [f"log.run_dir={run}", "model.vocab_size=320"]) == 2
    err = capsys.readouterr().err.strip()
    assert re.fullmatch(rf"error: \S+/step_20: saved with a different model: model.vocab_size: \d+ in the checkpoint, "
                        rf"320 now. To train this model, {re.escape(fresh)}; or resume with the checkpoint's "
                        r"recipe.yaml", err), err
    assert main(RUN + variant.overrides() + [f"log.run_dir={run}"]) == 2  # the same model: the tokenizer's
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(
        rf"its ids mean other tokens. To train on this data, {re.escape(fresh)}; or resume onto data of the "
        r"checkpoint's tokenizer \(data.allow_tokenizer_change=true continues on these ids anyway\)$", err), err


def test_no_resume_starts_fresh(ref, tmp_path, capsys):
    run = copy_run(ref, tmp_path)
    assert main(RUN + variant.overrides(RUN) + [f"log.run_dir={run}", "train.steps=2", "--no-resume"]) == 0
    out = capsys.readouterr().out
    assert "--no-resume: starting fresh" in out and "step      1 |" in out
    ck = run / "checkpoints"
    assert (ck / ".abandoned-step_20").is_dir()  # set aside, not deleted, not resumable
    assert (ck / "latest").read_text().strip() == "step_2"
    assert resolve(run) == ck / "step_2"
    assert list(losses(run)) == [1, 2]  # the old run's records are set aside too, not mixed in
    assert len((run / "metrics.abandoned.jsonl").read_text().splitlines()) == 20


@pytest.mark.quick
def test_metadata_pickle_with_foreign_objects_is_refused(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(CheckpointError, match="refusing to unpickle"):
        SafeReader(tmp_path).read_metadata()


# ---------------------------------------------------------------------------------------------
# Hugging Face export


def test_export_loads_in_transformers_with_same_logits(ref, tmp_path):
    """(With validate.py --set, a plain run of its own: transformers has no variant's switch.)"""
    transformers = pytest.importorskip("transformers")
    from pithtrain.checkpoint.export import load_checkpoint_model

    if variant.switches():
        ref = tmp_path / "plain"
        train(load_config(None, RUN + ["train.steps=1", f"log.run_dir={ref}"]))

    out = subprocess.run([sys.executable, "-m", "pithtrain.checkpoint.export", "--ckpt", str(ref),
                          "--out", str(tmp_path / "hf"), "--dtype", "float32"], capture_output=True, text=True,
                         timeout=180,
                         env=SUB_ENV)
    assert out.returncode == 0, out.stderr[-2000:]
    ours = load_checkpoint_model(resolve(ref))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").float().eval()
    x = torch.randint(0, 258, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(x).logits, ours(x), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Resharding: 4 gloo processes (fsdp=2 x ep=2) <-> one process


RESHARD = ["train.steps=4", "checkpoint.every=2", "train.device=cpu", "log.every=1"]
PROBE = torch.randint(0, 258, (2, 32), generator=torch.Generator().manual_seed(1))


def _reshard_worker(rank: int, world: int, port: int, tmp: str, ref_ckpt: str):
    """Phase 1: train 4 steps on fsdp=2 x ep=2 (recipe fsdp=4 ep=2: ep borrows fsdp ranks),
    checkpoints at 2 and 4. Phase 2: load the single-process reference checkpoint into this
    layout. Rank 0 writes full parameters, losses and logits of both phases."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    layout = ["parallel.fsdp=4", "parallel.ep=2"]
    out = {}
    for phase, run, extra, resume in (("saved", "run4", RESHARD, False),
                                      ("loaded", "run4b", ["train.steps=20"], ref_ckpt)):
        base = RUN + layout + extra
        hist, model = train(load_config(None, base + variant.overrides(base) + [f"log.run_dir={tmp}/{run}"]),
                            resume=resume)
        params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                  for n, p in model.named_parameters()}
        with torch.no_grad():
            logits = model(PROBE)
        out[phase] = {"params": params, "logits": logits, "loss": [h["loss"] for h in hist]}
    if rank == 0:
        torch.save(out, os.path.join(tmp, "reshard.pt"))
    dist.destroy_process_group()


def test_reshard_between_four_processes_and_one(ref, tmp_path):
    import socket


    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spawn(_reshard_worker, args=(4, port, str(tmp_path), str(ref / "checkpoints" / "step_20")), nprocs=4)
    got = torch.load(tmp_path / "reshard.pt", weights_only=True)

    # 4 -> 1: the sharded checkpoint loads into one process with the same parameters, exactly
    saved = tmp_path / "run4" / "checkpoints"
    _, params, _, _ = restored(saved / "step_4", tmp_path / "run1")
    assert_same({n: params[n] for n in got["saved"]["params"]}, got["saved"]["params"])
    cfg1 = cfg_for(tmp_path / "run1")
    model = build_model(cfg1.model, "cpu")
    model.load_state_dict(params)
    with torch.no_grad():  # same weights; EP sums a token's experts in a different order
        torch.testing.assert_close(model(PROBE), got["saved"]["logits"], rtol=1e-5, atol=1e-5)

    # ... and optimizer moments and LR schedule too: one process resumed from the 4-process step 2
    # (grad_accum 4 = the same global batch) trains steps 3-4 like the 4 processes did
    hist, _ = train(cfg_for(tmp_path / "run1", *RESHARD, "train.grad_accum=4"),
                 resume=str(saved / "step_2"))
    assert [h["step"] for h in hist] == [3, 4]
    torch.testing.assert_close([h["loss"] for h in hist], got["saved"]["loss"][2:], rtol=1e-5, atol=0)

    # 1 -> 4: the single-process reference checkpoint loaded into fsdp=2 x ep=2
    ref_model = build_model(cfg1.model, "cpu")
    ref_model.load_state_dict(restored(ref / "checkpoints" / "step_20", ref)[1])
    with torch.no_grad():
        torch.testing.assert_close(got["loaded"]["logits"], ref_model(PROBE), rtol=1e-5, atol=1e-5)
