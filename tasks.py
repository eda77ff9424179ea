"""Invoke tasks: the one command surface of PithTrain (`invoke --list`, `invoke --help TASK`).

    invoke train                                             # embedded default recipe, native runtime
    invoke test                                              # the CPU test suite (what CI runs)
    invoke train --gpu=b200 --model=gpt-oss-20b --dry-run    # the docker + torchrun lines it would run
    invoke setup --gpu=auto                                  # a fresh rented GPU box, one command
    invoke plan --model=qwen3-30b-a3b --gpu=h100 --gpus=8    # per-rank memory plan, before launch

Runtime. `--gpu` names the hardware and so the image (h100/h200 -> hopper, b200/b300 -> blackwell,
auto -> ask nvidia-smi) and adds the GPU's recipe overrides (pithtrain/gpus.py).
With `--gpu`, commands run in that pinned image through the compose files (`--runtime=docker`);
without it, or when already inside the image, they run here (`--runtime=native`). Either way
`train --gpu` starts one process per visible GPU (`--nproc` chooses), and natively says how many
and why, after checking the recipe for that many here. `--dry-run`
prints the exact commands instead of running them. The command lines themselves are built by
tools/appliance.py; this file only chooses and runs them.

Any directory inside the checkout works: invoke finds this file upwards, paths given to a task are
read from where you are, and docker lines (whose compose/ and images/ paths are the checkout's) run
from its root, which `--dry-run` shows.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from invoke import task
from invoke.exceptions import Exit

from tools import appliance as ap

ROOT = Path(__file__).resolve().parent
# The Pythons started here import pithtrain and tools (python -m tools.appliance) from any directory.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
PY = shlex.quote(sys.executable)
H_GPU = "h100 | h200 | b200 | b300 | auto: run in that GPU's pinned image with its recipe overrides"
H_RUNTIME = "docker | native (default: docker with --gpu, native without it or inside the image)"
H_DRY = "print the exact commands instead of running them"
H_MODEL = "embedded recipe name, pithtrain/recipes/<MODEL>.yaml (e.g. gpt-oss-20b)"
H_RECIPE = "recipe YAML file or embedded recipe name (default: embedded default)"
H_SET = "override section.key=value (repeatable)"
H_NPROC = ("processes per node (default: every visible GPU with --gpu, in docker and for multi-node launch; "
           "else 1)")


def _py(c, args: str, **kw):
    return c.run(f"{PY} {args}", pty=False, **kw)


# ---------------------------------------------------------------------------------------------
# Shared plumbing: which image, which runtime, print or run.


def _gpu(gpu: str) -> str | None:
    if not gpu:
        return None
    gpu = gpu.lower()  # --gpu=H200 as printed on the box
    try:
        gpu = ap.detect_gpu() if gpu == "auto" else gpu
        ap.target_for(gpu)
    except ap.ApplianceError as e:
        raise Exit(f"error: {e}", 2)
    return gpu


def _runtime(runtime: str, gpu: str | None, dry_run: bool = False) -> str:
    """docker with --gpu, native without it, inside the image, or where docker is missing."""
    if runtime not in ("", "docker", "native"):
        raise Exit(f"error: --runtime={runtime}: use docker or native", 2)
    if os.environ.get("PITHTRAIN_TARGET"):  # set by the image: we are already inside it
        return "native"
    if runtime == "docker" and gpu is None:
        raise Exit("error: --runtime=docker needs --gpu (the GPU picks the image)", 2)
    if runtime:
        return runtime
    if gpu is None:
        return "native"
    why = None if dry_run else _docker_problem()  # a dry run shows what the appliance would do
    if why:
        print(f"note: {why}: running natively, not in the pinned image (--runtime=docker insists)",
              file=sys.stderr)
        return "native"
    return "docker"


def _docker_problem() -> str | None:
    """Why docker cannot run containers here (no CLI, or a CLI whose daemon does not answer), or None."""
    if not shutil.which("docker"):
        return "docker not found"
    try:
        r = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True,
                           text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"docker does not answer ({e})"
    if r.returncode:
        last = (r.stderr.strip().splitlines() or ["`docker info` failed"])[-1]
        return f"docker is installed but its daemon does not answer ({last})"
    return None


def _image(gpu: str) -> tuple[str, dict]:
    try:
        target = ap.target_for(gpu)
        return target, ap.load_versions()["targets"][target]
    except ap.ApplianceError as e:
        raise Exit(f"error: {e}", 2)


def _recipe(recipe: str, model: str) -> str:
    if recipe and model:
        raise Exit("error: give --model or --recipe, not both", 2)
    return recipe or model


def _docker_ready(line: str):
    """A docker line needs a running engine: say so in one line before trying."""
    if line.split()[0] == "docker" or " docker " in line:
        if why := _docker_problem():
            raise Exit(f"error: {why}; start it or use --runtime=native", 2)


def _emit(c, lines: list[str], dry_run: bool):
    """Print (dry run) or run each shell line in order; a failing line stops the task."""
    for line in map(_from_root, lines):
        if dry_run:
            print(line)
            continue
        _docker_ready(line)
        print(f"+ {line}", file=sys.stderr)
        c.run(line, pty=False)


# torchrun passes these on to its workers, and waits this long for a save before SIGKILL
# (images/Dockerfile sets the same inside the image; docs/reliability.md)
TORCHRUN_ENV = {"PET_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
                "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "300"}


def _run_trainer(c, lines: list[str], dry_run: bool, echo: bool = True):
    """_emit for train and launch: the last line (the trainer, torchrun or the container) runs in
    its own process group, and SIGTERM, SIGINT and SIGUSR1 sent to this task are passed on to it
    once; the task waits for it (no trainer is left holding the run dir) and exits with its code
    (after a notice 128 + its number, which the ranks return, and NATIVE_TORCHRUN with them)."""
    _emit(c, lines[:-1], dry_run)
    line = lines[-1]
    if dry_run:
        return _emit(c, [line], dry_run)
    _docker_ready(line)
    if echo:
        print(f"+ {_from_root(line)}", file=sys.stderr)
    for k, v in TORCHRUN_ENV.items():
        os.environ.setdefault(k, v)
    # bash execs a simple command, so the signal reaches the trainer itself; a new session keeps a
    # terminal's Ctrl-C from reaching it a second time, past this task
    p = subprocess.Popen(["bash", "-c", line], cwd=ROOT if "docker " in line else None, start_new_session=True)
    sent = []

    def forward(signum, _):
        sent.append(signum)
        p.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    try:
        code = p.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if code:
        raise Exit(code=128 + sent[0] if sent else 128 - code if code < 0 else code)


def _from_root(line: str) -> str:
    """A docker line, run from the checkout's root when invoke was started elsewhere inside it."""
    return line if "docker " not in line or Path.cwd() == ROOT else f"cd {shlex.quote(str(ROOT))} && {line}"


def _in_image(gpu: str, cmd: list[str], file: str = "train.yaml", service: str = "train",
              env: dict | None = None) -> list[str]:
    """Shell lines that run `cmd` in the pinned image of `gpu` (built first if missing)."""
    target, pins = _image(gpu)
    env = {"PITHTRAIN_IMAGE": ap.image_name(target, pins), **(env or {})}
    return [ap.ensure_image(target, pins), ap.compose(file, service, env, cmd)]


def _python(runtime: str, gpu: str | None, module_args: list[str]) -> list[str]:
    """`python -m ...` natively, or in the image for `gpu`."""
    if runtime == "native":
        return [f"{PY} {shlex.join(module_args)}"]
    return _in_image(gpu, ["python", *module_args])


def _visible_gpus() -> int:
    """The GPUs this process sees, as torchrun's --nproc-per-node=gpu counts them (torch imported
    here: a docker host needs none)."""
    import torch

    return torch.cuda.device_count()


def _native_procs(nproc: str, gpu: str | None) -> tuple[str, str | None]:
    """How many trainer processes start here natively, and why (None: nothing was chosen, the
    plain one-process run without --gpu or --nproc). With --gpu, as in the image: every visible GPU."""
    if nproc:
        return nproc, f"--nproc={nproc}"
    if gpu is None:
        return "1", None
    n = _visible_gpus()
    if n > 1:
        return str(n), f"--gpu={gpu}: one per visible GPU; --nproc=N for fewer"
    return "1", f"--gpu={gpu}: {n} GPU visible"


def _world(nproc: str, nodes: int = 1) -> int:
    """The world size torchrun will make of --nproc-per-node (a number, gpu, auto or cpu)."""
    if nproc.isdigit():
        n = int(nproc)
    else:
        n = _visible_gpus() if nproc in ("gpu", "auto") else 0
        n = n or os.cpu_count() or 1  # auto and cpu without a GPU: one per core, as torchrun does
    return n * nodes


def _check_recipe(args: list[str], world: int):
    """Resolve and check the recipe for `world` processes here, before torchrun starts them: a
    mistake is one line, once, exit 2, not one per rank inside torchrun's traceback."""
    from pithtrain.train import main as trainer

    code = trainer(["--check", str(world), *args])
    if code:
        raise Exit(code=code)


@contextlib.contextmanager
def _starting():
    """Ctrl-C before the trainer starts (counting GPUs and the recipe check import torch: seconds)."""
    try:
        yield
    except KeyboardInterrupt:
        raise Exit("invoke: stopped by SIGINT before the trainer started; nothing saved", 130) from None


# torchrun here: the trainer's code and words at its end, not torchrun's traceback (tools/appliance.py)
NATIVE_TORCHRUN = [sys.executable, "-m", "tools.appliance", "torchrun"]


def _train_lines(runtime, gpu, args, nproc, multinode=None) -> list[str]:
    if runtime == "native":
        if multinode is None and nproc in ("", "1"):
            return [f"{PY} -m pithtrain.train {shlex.join(args)}".rstrip()]
        # a multi-node launch (compose's default command, inside the image) uses every GPU of the node
        default = "gpu" if multinode is not None else "1"
        cmd = ap.torchrun(nproc or default, args, multinode, launcher=NATIVE_TORCHRUN)
        return [shlex.join(cmd)]
    cmd = ap.torchrun(nproc or "gpu", args, multinode)
    env = {k: multinode[k] for k in (*ap.MULTINODE_ENV, "RUN_ID")} if multinode else None
    return _in_image(gpu, cmd, "multinode.yaml" if multinode else "train.yaml", env=env)


# ---------------------------------------------------------------------------------------------
# Training


@task(help={"recipe": H_RECIPE, "model": H_MODEL, "set": H_SET, "gpu": H_GPU,
            "runtime": H_RUNTIME, "nproc": H_NPROC, "dry_run": H_DRY,
            "resume": "continue from this checkpoint (default: the newest valid one in log.run_dir)",
            "no_resume": "start fresh; existing checkpoints in log.run_dir are set aside"},
      iterable=["set"])
def train(c, recipe="", model="", set=None, gpu="", runtime="", nproc="", dry_run=False, resume="",
          no_resume=False):
    """Train from a recipe (no arguments: the tiny embedded default on CPU or the visible GPU)."""
    if resume and no_resume:
        raise Exit("error: --resume and --no-resume exclude each other", 2)
    gpu_ = _gpu(gpu)
    rt = _runtime(runtime, gpu_, dry_run)
    args = ap.train_args(_recipe(recipe, model), gpu_, set or [])
    args += [f"--resume={resume}"] if resume else ["--no-resume"] if no_resume else []
    if rt == "docker":
        _run_trainer(c, _train_lines(rt, gpu_, args, nproc), dry_run)
        return
    with _starting():
        n, why = _native_procs(nproc, gpu_)
        if why:
            print(f"invoke: {n} process{'' if n == '1' else 'es'} ({why})", file=sys.stderr)
        if n != "1" and not dry_run:
            _check_recipe(args, _world(n))
    if n == "1":  # the plain command (README quick start, CI): no echo, the trainer's exit code
        _run_trainer(c, [f"{PY} -m pithtrain.train {shlex.join(args)}".rstrip()], dry_run, echo=False)
        return
    _run_trainer(c, _train_lines(rt, gpu_, args, n), dry_run)


@task(help={"recipe": H_RECIPE, "model": H_MODEL + " (default: $PITHTRAIN_MODEL)", "set": H_SET,
            "gpu": H_GPU + " (default: $PITHTRAIN_GPU)", "runtime": H_RUNTIME,
            "nproc": H_NPROC, "dry_run": H_DRY},
      iterable=["set"])
def launch(c, recipe="", model="", set=None, gpu="", runtime="", nproc="", dry_run=False):
    """Multi-node training, run on every node (torchrun c10d rendezvous from the environment).

    Needs MASTER_ADDR, MASTER_PORT, NNODES, NODE_RANK; RUN_ID is optional (the same on every node).
    """
    try:
        env = ap.multinode_env(os.environ)
    except ap.ApplianceError as e:
        raise Exit(f"error: {e}", 2)
    gpu_ = _gpu(gpu or os.environ.get("PITHTRAIN_GPU", ""))
    rt = _runtime(runtime, gpu_, dry_run)
    recipe_ = _recipe(recipe, model) or os.environ.get("PITHTRAIN_MODEL", "")
    args = ap.train_args(recipe_, gpu_, set or [])
    if rt == "native" and not dry_run:  # torchrun starts here: the recipe is checked first
        with _starting():
            _check_recipe(args, _world(nproc or "gpu", int(env["NNODES"])))
    _run_trainer(c, _train_lines(rt, gpu_, args, nproc, multinode=env), dry_run)


@task(help={"recipe": H_RECIPE, "model": H_MODEL, "set": H_SET, "gpu": H_GPU,
            "runtime": H_RUNTIME, "nproc": H_NPROC, "steps": "training steps to capture",
            "pipeline": "draw the pipeline schedule (python -m pithtrain.pipeline_viz) instead",
            "dry_run": H_DRY},
      iterable=["set"])
def profile(c, recipe="", model="", set=None, gpu="", runtime="", nproc="", steps=20,
            pipeline=False, dry_run=False):
    """Nsight Systems timeline of a short run, written to runs/profile/<name>.nsys-rep."""
    gpu_ = _gpu(gpu)
    rt = _runtime(runtime, gpu_, dry_run)
    recipe_ = _recipe(recipe, model)
    if pipeline:
        lines = _python(rt, gpu_, ["-m", "pithtrain.pipeline_viz",
                                   *ap.train_args(recipe_, gpu_, set or [])])
        _emit(c, lines, dry_run)
        return
    name = Path(recipe_ or "default").stem
    args = ap.train_args(recipe_, gpu_, [*(set or []), f"train.steps={steps}"])
    nsys = ["nsys", "profile", "--trace=cuda,nvtx,osrt", "--sample=none", "--force-overwrite=true",
            f"--output=runs/profile/{name}"]
    if rt == "native":
        if not dry_run and not shutil.which("nsys"):
            raise Exit("error: nsys is not installed here (it is in the images: use --gpu=...)", 2)
        cmd = nsys + ap.torchrun(nproc or "1", args,
                                 launcher=[sys.executable, "-m", "torch.distributed.run"])
        _emit(c, [shlex.join(cmd)], dry_run)
    else:
        _emit(c, _in_image(gpu_, nsys + ap.torchrun(nproc or "gpu", args)), dry_run)


@task(help={"recipe": H_RECIPE, "model": H_MODEL, "set": H_SET, "gpu": H_GPU,
            "runtime": H_RUNTIME, "nproc": H_NPROC, "steps": "steps of the check run",
            "dry_run": H_DRY},
      iterable=["set"])
def validate(c, recipe="", model="", set=None, gpu="", runtime="", nproc="", steps=30,
             dry_run=False):
    """PASS/FAIL: a short run whose logged loss is finite and falls (first 5 vs last 5 steps)."""
    gpu_ = _gpu(gpu)
    rt = _runtime(runtime, gpu_, dry_run)
    recipe_ = _recipe(recipe, model)
    run_dir = f"runs/validate/{Path(recipe_ or 'default').stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    args = ap.train_args(recipe_, gpu_, [*(set or []), f"train.steps={steps}", "log.every=1",
                                         f"log.run_dir={run_dir}"])
    check = ["-m", "tools.appliance", "check-loss", f"{run_dir}/metrics.jsonl"]
    lines = _train_lines(rt, gpu_, args, nproc) + _python(rt, gpu_, check)
    if rt == "docker":
        lines = lines[:2] + lines[3:]  # one ensure-image line is enough
    _emit(c, lines, dry_run)


@task(help={"gpu": H_GPU, "runtime": H_RUNTIME,
            "args": "arguments passed to python -m pithtrain.bench, quoted as one string",
            "fp8": "also time the default variant with FP8 expert GEMMs (ratio to bf16 in the table)",
            "dry_run": H_DRY})
def bench(c, gpu="", runtime="", args="", fp8=False, dry_run=False):
    """The single-GPU benchmark suite (docs/bench.md): PithTrain vs transformers and torchtitan, one run."""
    gpu_ = _gpu(gpu)
    rt = _runtime(runtime, gpu_, dry_run)
    extra = ["--fp8"] if fp8 else []
    _emit(c, _python(rt, gpu_, ["-m", "pithtrain.bench", *shlex.split(args), *extra]), dry_run)


@task(help={"recipe": H_RECIPE, "model": H_MODEL, "set": H_SET,
            "gpu": "h100 | h200 | b200 | b300: the GPU whose memory the plan is held against",
            "gpus": "GPUs per node (default 1)", "nodes": "nodes (default 1); world size = gpus x nodes",
            "json": "print one JSON object (layout, peak_gib, gpu_gib, fits, per-rank bytes)"},
      iterable=["set"])
def plan(c, recipe="", model="", set=None, gpu="", gpus=1, nodes=1, json=False):
    """Memory plan before launch: per-rank parameters, gradients, optimizer state, activations,
    communication buffers and peak against the GPU, and the layout (`parallel: auto` chooses it).
    Runs here, on the CPU: the model is built on the meta device under a fake process group."""
    if not gpu:
        raise Exit("error: plan needs --gpu (h100 | h200 | b200 | b300): whose memory to plan against", 2)
    recipe_ = _recipe(recipe, model)
    args = ["-m", "pithtrain.plan", f"--gpu={gpu}", f"--gpus={gpus}", f"--nodes={nodes}",
            *([f"--model={recipe_}"] if recipe_ else []), *(f"--set={s}" for s in set or []),
            *(["--json"] if json else [])]
    result = _py(c, shlex.join(args), warn=True)
    if result.exited:
        sys.exit(result.exited)


@task(help={"recipe": H_RECIPE, "model": H_MODEL, "set": H_SET,
            "gpu": "h100 | h200 | b200 | b300: the target GPU, whose memory caps the run (default: the GPU here)",
            "gpus": "the world size to emulate (default 8: one node)", "steps": "steps to run (default 5)",
            "warmup": "steps left out of the measured median (default 2: compilation)",
            "json": "print one JSON object"},
      iterable=["set"])
def emulate(c, recipe="", model="", set=None, gpu="", gpus=8, steps=5, warmup=2, json=False):
    """Rank 0 of an N-GPU layout run on this one GPU (pithtrain/emulate.py): the other ranks'
    collectives stood in for, memory capped at the target GPU's; the measured step and peak memory
    beside the memory plan and the performance model. Runs natively, as `invoke plan` does."""
    recipe_ = _recipe(recipe, model)
    args = ["-m", "pithtrain.emulate", *([recipe_] if recipe_ else []), f"--gpus={gpus}", f"--steps={steps}",
            f"--warmup={warmup}", *([f"--gpu={gpu}"] if gpu else []), *(f"--set={s}" for s in set or []),
            *(["--json"] if json else [])]
    result = _py(c, shlex.join(args), warn=True)
    if result.exited:
        sys.exit(result.exited)


# ---------------------------------------------------------------------------------------------
# Images and environment


@task(help={"gpu": H_GPU, "registry": "registry prefix: pull the image from there if present "
                                      "(default: $PITHTRAIN_REGISTRY)",
            "push": "push the built image to --registry",
            "refresh_digest": "ask the registry for the base tag's current digest and write it "
                              "into images/versions.yaml (then rebuild)",
            "dry_run": H_DRY})
def build(c, gpu="", registry="", push=False, refresh_digest=False, dry_run=False):
    """Build (or pull) the pinned image for a GPU; the tag is a hash of its versions.yaml pins."""
    gpu_ = _gpu(gpu)
    if gpu_ is None:
        raise Exit("error: build needs --gpu (h100 | h200 | b200 | b300 | auto)", 2)
    if push and not (registry or os.environ.get("PITHTRAIN_REGISTRY")):
        raise Exit("error: --push needs --registry (or $PITHTRAIN_REGISTRY): where to push", 2)
    target, pins = _image(gpu_)
    if refresh_digest:
        ref = f"{pins['base_image']}:{pins['base_tag']}"
        cmd = ["docker", "buildx", "imagetools", "inspect", "--format", "{{.Manifest.Digest}}", ref]
        if dry_run:
            print(shlex.join(cmd))
            return
        try:
            new = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError) as e:
            detail = getattr(e, "stderr", None) or str(e)
            raise Exit(f"error: {shlex.join(cmd)} failed (docker buildx and registry access are "
                       f"needed): {detail.strip()}", 2)
        if not new.startswith("sha256:"):
            raise Exit(f"error: {ref}: the registry answered {new!r}, not a digest", 2)
        text = ap.VERSIONS.read_text()
        ap.VERSIONS.write_text(text.replace(pins["base_digest"], new))  # every target on this tag
        print(f"{ref}: {pins['base_digest']} -> {new} (images/versions.yaml)")
        return
    _emit(c, _build_lines(target, pins, registry or os.environ.get("PITHTRAIN_REGISTRY", ""),
                          push), dry_run)


def _build_lines(target: str, pins: dict, registry: str, push: bool) -> list[str]:
    name = ap.image_name(target, pins)
    build = shlex.join(ap.build_command(target, pins))
    if not registry:
        return [build]
    remote = f"{registry.rstrip('/')}/{name}"
    lines = [f"(docker pull {remote} && docker tag {remote} {name}) || {build}"]
    if push:
        lines.append(f"docker tag {name} {remote} && docker push {remote}")
    return lines


@task(help={"gpu": H_GPU + " (default: the image's own target inside it)",
            "runtime": H_RUNTIME,
            "manifest": "check this manifest file instead of this environment",
            "skill": "also check this skill's prerequisites (python -m tools.skills check)",
            "dry_run": H_DRY})
def doctor(c, gpu="", runtime="", manifest="", skill="", dry_run=False):
    """Compare the environment (or an image manifest) with images/versions.yaml; exit 1 on drift.

    Inside the image it checks the build's manifest and the live environment (where the pinned
    kernel packages, flash-attn-4 and DeepGEMM, must also import); outside it, with --gpu, it runs
    itself in that image (docker) or checks this machine against it (native)."""
    gpu_ = _gpu(gpu)
    rt = "native" if manifest else _runtime(runtime, gpu_, dry_run)
    if rt == "docker":
        _emit(c, _in_image(gpu_, ["invoke", "doctor", *(["--skill", skill] if skill else [])]),
              dry_run)
        return
    problems = []
    if skill:
        r = _py(c, f"-m tools.skills check {shlex.quote(skill)}", warn=True)
        problems += [f"skill {skill}: prerequisites missing (above)"] if r.exited else []
    target = ap.target_for(gpu_) if gpu_ else os.environ.get("PITHTRAIN_TARGET")
    if target is None and not skill:
        raise Exit("error: doctor: which image? give --gpu (outside the image)", 2)
    checks = []  # (what was checked, its manifest)
    if target is not None:
        pins = ap.load_versions()["targets"][target]
        if manifest:
            try:
                checks.append((manifest, json.loads(Path(manifest).read_text())))
            except (OSError, ValueError) as e:
                raise Exit(f"error: doctor --manifest: cannot read {manifest}: {e}", 2)
        else:
            if ap.MANIFEST.is_file():
                checks.append((f"image manifest {ap.MANIFEST}", json.loads(ap.MANIFEST.read_text())))
            checks.append(("this environment", ap.collect_manifest()))
        problems += [f"{what}: {p}" for what, m in checks for p in ap.drift(m, target, pins)]
        if not manifest:  # the live environment: the kernel packages must load, not only be installed
            problems += [f"this environment: {p}" for p in ap.import_problems(pins)]
        if not manifest and shutil.which("nvidia-smi"):
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                                  "--format=csv,noheader"], capture_output=True, text=True)
            p = out.stdout.split() and ap.driver_problem(out.stdout.split()[0], pins["driver_min"])
            problems += [f"host: {p}"] if p else []
    for p in problems:
        print(p)
    checked = [f"{w} against images/versions.yaml target {target}" for w, _ in checks]
    checked = "; ".join(checked + ([f"skill {skill} prerequisites"] if skill else []))
    if problems:
        raise Exit(f"doctor: FAIL, {len(problems)} problem(s) ({checked})", 1)
    print(f"doctor: PASS ({checked})")


@task(help={"gpu": H_GPU + " (default: auto)",
            "registry": "pull the image from this registry prefix when present "
                        "(default: $PITHTRAIN_REGISTRY)",
            "recipe": H_RECIPE + ": the run to plan after the smoke test", "model": H_MODEL,
            "set": H_SET, "gpus": "GPUs per node for the plan (default: every GPU nvidia-smi lists)",
            "nodes": "nodes of the run, for the plan (default 1)", "dry_run": H_DRY},
      iterable=["set"])
def setup(c, gpu="auto", registry="", recipe="", model="", set=None, gpus=0, nodes=1, dry_run=False):
    """One-command setup of a fresh GPU box: checks, image, doctor, smoke test, memory plan.

    Checks the driver, Docker and the NVIDIA container runtime, builds (or pulls) the image for
    the GPU, then runs in it `invoke doctor`, `invoke validate` (the tiny default recipe on every
    GPU of the node, `parallel: auto`) and, given --model or --recipe, `invoke plan` of that run."""
    if dry_run and gpu == "auto":
        raise Exit("error: setup --dry-run: name the GPU (--gpu=h200 ...), nothing is detected", 2)
    recipe_ = _recipe(recipe, model)
    if dry_run and recipe_ and not gpus:
        raise Exit("error: setup --dry-run: name --gpus for the plan, nothing is detected", 2)
    gpu_ = _gpu(gpu)
    target, pins = _image(gpu_)
    checks = [
        "nvidia-smi --query-gpu=name,driver_version --format=csv,noheader",
        "docker info --format '{{.ServerVersion}}'",
        # The NVIDIA Container Toolkit registers a runtime (or CDI specs) that GPU reservations need.
        "docker info --format '{{json .Runtimes}}' | grep -q nvidia || ls /etc/cdi/nvidia.yaml "
        "/var/run/cdi/nvidia*.yaml >/dev/null 2>&1 || (echo 'error: no NVIDIA container runtime: "
        "install nvidia-container-toolkit' >&2; exit 1)",
    ]
    if not dry_run:
        for tool in ("nvidia-smi", "docker"):
            if not shutil.which(tool):
                raise Exit(f"error: setup: {tool} not found on this machine", 2)
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                                 "--format=csv,noheader"], capture_output=True, text=True)
        problem = ap.driver_problem(driver.stdout.split()[0], pins["driver_min"])
        if problem:
            raise Exit(f"error: setup: {problem}", 2)
    lines = checks + _build_lines(target, pins, registry or os.environ.get("PITHTRAIN_REGISTRY", ""),
                                  False)
    env = {"PITHTRAIN_IMAGE": ap.image_name(target, pins)}
    lines.append(ap.compose("train.yaml", "train", env, ["invoke", "doctor"]))
    lines.append(ap.compose("train.yaml", "train", env, ["invoke", "validate", "--nproc=gpu",
                                                         "--set=parallel.auto=true"]))
    if recipe_:
        if not gpus:
            listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
            gpus = len(listed.strip().splitlines())
        lines.append(ap.compose("train.yaml", "train", env, [
            "invoke", "plan", f"--gpu={gpu_}", f"--gpus={gpus}", f"--nodes={nodes}", f"--recipe={recipe_}",
            *(f"--set={o}" for o in set or [])]))
    _emit(c, lines, dry_run)


@task(help={"gpu": H_GPU + " (picks the image)", "gpus": "give the sandbox the host's GPUs (default: none)",
            "network": "give the sandbox a bridge network (default: none)", "dry_run": H_DRY})
def shell(c, gpu="", gpus=False, network=False, dry_run=False):
    """The agent sandbox: a shell in the pinned image (compose/sandbox.yaml).

    Repository read-only at /workspace, a writable work directory at /work ($PITHTRAIN_SANDBOX_WORK,
    default runs/sandbox), its own cache volume, non-root, read-only root filesystem, no
    capabilities, no privilege escalation, pids / memory / CPU limits; GPUs only with --gpus, a
    network only with --network (never from the environment)."""
    gpu_ = _gpu(gpu)
    if gpu_ is None or os.environ.get("PITHTRAIN_TARGET"):
        raise Exit("error: shell opens the sandbox container: give --gpu, outside the image", 2)
    service = "agent" + ("-gpu" if gpus else "") + ("-net" if network else "")
    lines = [_from_root(line) for line in _in_image(gpu_, [], file="sandbox.yaml", service=service)]
    if dry_run:
        print("\n".join(lines))
        return
    # created here, as this user, so the container's uid can write it (docker would create it as root)
    (Path(__file__).parent / "compose" / os.environ.get("PITHTRAIN_SANDBOX_WORK", "../runs/sandbox")).mkdir(
        parents=True, exist_ok=True)
    c.run(lines[0], pty=False)
    os.execvp("bash", ["bash", "-c", lines[1]])  # hand the terminal to the container


# ---------------------------------------------------------------------------------------------
# Data, checkpoints, information


@task(help={"inputs": "comma-separated .txt / .jsonl / .json / .csv (also .gz .bz2 .xz .zst) / .parquet / .arrow "
                      "files, directories or globs of them, `datasets` directories (save_to_disk) or a hub dataset id",
            "tokenizer": "directory holding tokenizer.json, the file, or a hub id",
            "out": "output directory for the shards, meta.json and tokenizer.json",
            "text_key": "the text field of the records", "split": "dataset split (directories, hub ids)",
            "num_proc": "tokenizer processes (default: every core)",
            "eos": "the token that ends each document (default: </s>, <|endoftext|>, <eos> or <|end_of_text|>)",
            "weights": "comma-separated, one per input: times its documents are written (2: twice, 0.5: half)",
            "gpu": H_GPU, "runtime": H_RUNTIME, "dry_run": H_DRY})
def prepare_data(c, inputs, tokenizer, out, text_key="text", split="train", num_proc=0, eos="", weights="",
                 gpu="", runtime="", dry_run=False):
    """Tokenize documents into memory-mapped shards (data.source: shards, data.path: OUT)."""
    gpu_ = _gpu(gpu)
    _emit(c, _python(_runtime(runtime, gpu_, dry_run), gpu_,
                     ["-m", "pithtrain.data", "--inputs", inputs, "--tokenizer", tokenizer, "--out", out,
                      "--text-key", text_key, "--split", split]
                     + (["--num-proc", str(num_proc)] if num_proc else []) + (["--eos", eos] if eos else [])
                     + (["--weights", weights] if weights else [])), dry_run)


@task(help={"recipe": H_RECIPE, "model": H_MODEL, "set": H_SET, "gpu": H_GPU + " (its recipe overrides)",
            "keys": "list every key of the recipe's sections with its type, default and the recipe's value"},
      iterable=["set"])
def config(c, recipe="", model="", set=None, gpu="", keys=False):
    """Print the resolved recipe (every key, after --set and the GPU's overrides), as training reads it."""
    args = ap.train_args(_recipe(recipe, model), _gpu(gpu), set or [])
    result = _py(c, shlex.join(["-m", "pithtrain.config", *args, *(["--keys"] if keys else [])]), warn=True)
    if result.exited:
        sys.exit(result.exited)


@task(help={"run_dir": "a run directory (log.run_dir)", "out": "PNG to write (default: RUN_DIR/metrics.png)"})
def plot(c, run_dir, out=""):
    """Loss, validation loss, tokens/s and expert load of a run as one PNG."""
    _py(c, shlex.join(["-m", "pithtrain.metrics", run_dir] + (["--out", out] if out else [])))


@task(help={"ckpt": "run dir, checkpoints dir or step_N dir", "prompt": "text to continue",
            "tokens": "new tokens to draw", "temperature": "0: greedy (deterministic)", "dry_run": H_DRY})
def sample(c, ckpt, prompt="", tokens=200, temperature=0.8, dry_run=False):
    """Sample text from a checkpoint with the run's tokenizer."""
    _emit(c, [f"{PY} " + shlex.join(["-m", "pithtrain.sample", "--ckpt", ckpt, "--prompt", prompt, "--tokens",
                                     str(tokens), "--temperature", str(temperature)])], dry_run)


@task(help={"ckpt": "checkpoint directory written by training (a step_N dir, checkpoints dir or run dir)",
            "out": "output directory for the Hugging Face model",
            "dtype": "the weights' dtype: bfloat16 | float32 (default: bfloat16)",
            "shard_mb": "output shard size in MB (default: the export's)",
            "gpu": H_GPU, "runtime": H_RUNTIME, "dry_run": H_DRY})
def export_hf(c, ckpt, out, dtype="", shard_mb=0, gpu="", runtime="", dry_run=False):
    """Export a checkpoint as a Hugging Face model directory (safetensors, config, tokenizer); the
    options are python -m pithtrain.checkpoint.export's."""
    gpu_ = _gpu(gpu)
    extra = (["--dtype", dtype] if dtype else []) + (["--shard-mb", str(shard_mb)] if shard_mb else [])
    _emit(c, _python(_runtime(runtime, gpu_, dry_run), gpu_,
                     ["-m", "pithtrain.checkpoint.export", "--ckpt", ckpt, "--out", out, *extra]), dry_run)


@task(help={"model": H_MODEL, "gpu": H_GPU, "runtime": H_RUNTIME, "dry_run": H_DRY})
def info(c, model="default", gpu="", runtime="", dry_run=False):
    """Parameters and FLOPs per token of a model recipe."""
    gpu_ = _gpu(gpu)
    rt = _runtime(runtime, gpu_, dry_run)
    _emit(c, _python(rt, gpu_, ["-m", "pithtrain.info", "--model", model]), dry_run)


@task(help={"path": "folder to count (default: the pithtrain package)"})
def stats(c, path="pithtrain"):
    """Code lines per folder (docstrings, comments and blanks excluded), so growth is visible in review."""
    counts = ap.count_lines(Path(__file__).parent / path)
    width = max(map(len, counts), default=10)
    for folder, n in counts.items():
        print(f"{folder:<{width}}  {n:6d}")
    print(f"{'total':<{width}}  {sum(counts.values()):6d}")


@task(help={"k": "only tests matching this pytest -k expression (one process)",
            "gpu": "run the GPU tests (pytest -m gpu) instead of the CPU suite",
            "quick": "the quick tier (pytest -m quick): every module's core contract in about a minute"})
def test(c, k="", gpu=False, quick=False):
    """Run the test suite (CPU by default; --quick: the inner loop; --gpu on a CUDA machine).

    The CPU suite and --quick lint first (ruff: pyflakes, import order, lines of at most 120; its
    settings in pyproject.toml; where ruff is installed, as the dev extra installs it), then run on
    two pytest workers (pytest-xdist; a file's tests stay in one worker, so its module fixtures are
    built once); the 15 slowest tests are printed, so a slow one is seen. With -k, one process: a
    few tests start faster than two workers that collect them all."""
    if gpu and quick:
        raise Exit("error: --quick is a CPU tier: give --quick or --gpu", 2)
    if not gpu and not k and importlib.util.find_spec("ruff"):
        with c.cd(str(ROOT)):
            lint = _py(c, "-m ruff check pithtrain tasks.py tools scripts tests", warn=True)
        if lint.exited:
            sys.exit(lint.exited)
    args = ["-m", "gpu"] if gpu else ["-m", "quick and not gpu"] if quick else []
    if k:
        args += ["-k", k]
    elif not gpu and importlib.util.find_spec("xdist"):  # the dev extra has it; an image may not
        args += ["-n", "2", "--dist", "loadfile"]
    args += ["--durations=15"]
    with c.cd(str(ROOT)):  # the whole suite from any directory of the checkout, not that directory's tests
        result = _py(c, "-m pytest " + " ".join(shlex.quote(a) for a in args), warn=True)
    if result.exited not in (0, 5):  # 5: no tests collected
        sys.exit(result.exited)
