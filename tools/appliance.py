"""The appliance: GPU -> image target, the docker / torchrun commands, and the pin-drift checks.

    invoke train --gpu=b200 --model=gpt-oss-20b --dry-run   # prints what tasks.py would run
    python tools/appliance.py manifest --out FILE            # run by the image build (stdlib + yaml)
    python -m tools.appliance check-loss runs/x/metrics.jsonl  # from the repository root
    python -m tools.appliance torchrun --nproc-per-node=2 --standalone -m pithtrain.train  # invoke train --nproc=2

Plain functions that build argument lists; tasks.py prints or runs them. This file must stay
importable on its own (the Dockerfiles copy it alone into the image to write the manifest), so it
imports only the standard library plus PyYAML, and pithtrain only inside the functions that run
from a checkout. It reads images/versions.yaml next to it: repository tooling, not in the package.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VERSIONS = REPO / "images" / "versions.yaml"
MANIFEST = Path("/etc/pithtrain/manifest.json")  # written by the image build

# One literal mapping: which image a GPU runs in.
GPU_TARGET = {"h100": "hopper", "h200": "hopper", "b200": "blackwell", "b300": "blackwell"}

# torchrun c10d rendezvous for multi-node runs reads these from the environment.
MULTINODE_ENV = {
    "MASTER_ADDR": "address of node 0, reachable from every node (it hosts the rendezvous store)",
    "MASTER_PORT": "a free TCP port on node 0, the same on every node",
    "NNODES": "number of nodes in the job",
    "NODE_RANK": "this node's index, 0..NNODES-1 (node 0 hosts the rendezvous store)",
}


class ApplianceError(Exception):
    """A problem phrased for a person; tasks print it and exit non-zero."""


# ---------------------------------------------------------------------------------------------
# Pins


def load_versions(path: str | Path = VERSIONS) -> dict:
    """images/versions.yaml, checked (the one loader: tasks, tests and the skills linter use it)."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ApplianceError(f"{path}: no versions file (the image pins live in images/versions.yaml)")
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict) or not isinstance(data.get("targets"), dict):
        raise ApplianceError(f"{path}: expected a mapping with a `targets` section")
    for target, pins in data["targets"].items():
        values = {**{k: v for k, v in pins.items() if k != "python_packages"},
                  **{f"python_packages.{k}": v for k, v in pins["python_packages"].items()}}
        for key, value in values.items():
            # YAML reads an unquoted 3.10 as the float 3.1: every pin must be written as a string.
            if not isinstance(value, str):
                raise ApplianceError(f"{path}: targets.{target}.{key}: write the pin as a string "
                                     f"(YAML read {value!r})")
    return data


def target_for(gpu: str) -> str:
    if gpu not in GPU_TARGET:
        raise ApplianceError(f"--gpu={gpu}: unknown GPU (known: {', '.join(GPU_TARGET)})")
    return GPU_TARGET[gpu]


def detect_gpu() -> str:
    """The GPU of this machine as a GPU_TARGET key, from nvidia-smi."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        raise ApplianceError("--gpu=auto: nvidia-smi found no NVIDIA GPU; name one with --gpu")
    from pithtrain.gpus import gpu_key  # here, not above: the image build runs this file alone

    names = out.strip().splitlines()
    gpu = gpu_key(names[0]) if names else None  # whole words: "NVIDIA GH200 480GB" is no h200 image
    if gpu in GPU_TARGET:
        return gpu
    raise ApplianceError(f"--gpu=auto: {names[0] if names else 'no GPU'} has no image target "
                         f"(known: {', '.join(GPU_TARGET)})")


def image_name(target: str, pins: dict) -> str:
    """Content-addressed tag: the same pins always name the same image, so it can be reused."""
    digest = hashlib.sha256(json.dumps(pins, sort_keys=True).encode()).hexdigest()[:12]
    return f"pithtrain-{target}:{digest}"


def pip_pins(pins: dict) -> list[str]:
    """The image's pinned Python set as pip requirements."""
    cu = "cu" + pins["cuda"].split(".")[0]  # the CUDA-major suffix of NVIDIA's wheel names
    reqs = [f"torch=={pins['torch']}", f"triton=={pins['triton']}",
            f"nvidia-nccl-{cu}=={pins['nccl']}", f"nvidia-cudnn-{cu}=={pins['cudnn']}"]
    if "flash_attn_4" in pins:
        reqs.append(f"flash-attn-4[{cu}]=={pins['flash_attn_4']}")
    return reqs + [f"{name}=={v}" for name, v in pins["python_packages"].items()]


def pip_platforms(pins: dict) -> list[str]:
    """manylinux tags the image's glibc accepts (pip 23 does not expand a given --platform)."""
    arch = {"linux/amd64": "x86_64", "linux/arm64": "aarch64"}[pins["platform"]]
    top = int(pins["glibc"].split(".")[1])
    return [f"manylinux_2_{m}_{arch}" for m in range(top, 16, -1)] + [f"manylinux2014_{arch}"]


def base_ref(pins: dict) -> str:
    return f"{pins['base_image']}:{pins['base_tag']}@{pins['base_digest']}"


def build_args(target: str, pins: dict) -> dict[str, str]:
    """Every ARG of images/Dockerfile for this target (a test checks the two sets are equal)."""
    args = {"BASE_IMAGE": base_ref(pins), "PITHTRAIN_TARGET": target,
            "PYTHON_VERSION": pins["python"], "NSYS_VERSION": pins["nsys"],
            "CUDA_ARCH": pins["cuda_arch"], "DRIVER_MIN": pins["driver_min"],
            "PIP_PACKAGES": " ".join(pip_pins(pins)), "DEEPGEMM_COMMIT": pins["deepgemm_commit"],
            "CUTLASS_COMMIT": pins["cutlass_commit"], "FMT_COMMIT": pins["fmt_commit"],
            "DEEPGEMM_PATCHES": pins["deepgemm_patches"]}
    return args


def build_command(target: str, pins: dict) -> list[str]:
    cmd = ["docker", "build", "--platform", pins["platform"],
           "-f", "images/Dockerfile", "-t", image_name(target, pins)]
    for k, v in build_args(target, pins).items():
        cmd += ["--build-arg", f"{k}={v}"]
    return cmd + ["."]


# ---------------------------------------------------------------------------------------------
# Commands


def train_args(recipe: str | None, gpu: str | None, overrides: list[str]) -> list[str]:
    """Arguments of `python -m pithtrain.train`: recipe, then the GPU's overrides, then the user's."""
    from pithtrain.gpus import GPUS  # here, not above: the image build runs this file alone

    return ([recipe] if recipe else []) + (list(GPUS[gpu].overrides) if gpu else []) + list(overrides)


def torchrun(nproc: int | str, args: list[str], multinode: dict | None = None,
             launcher: list[str] = ("torchrun",)) -> list[str]:
    """torchrun for one node (standalone) or, given multinode_env(), a c10d rendezvous."""
    cmd = list(launcher) + [f"--nproc-per-node={nproc}"]
    if multinode is None:
        cmd.append("--standalone")
    else:
        m = multinode
        # c10d assigns ranks by arrival; is_host says explicitly which node runs the TCP store
        # (the default guesses from the address, which fails behind DNS names and NAT).
        cmd += [f"--nnodes={m['NNODES']}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={m['MASTER_ADDR']}:{m['MASTER_PORT']}",
                f"--rdzv-id={m['RUN_ID']}",
                f"--rdzv-conf=is_host={'true' if m['NODE_RANK'] == '0' else 'false'}"]
    return cmd + ["-m", "pithtrain.train"] + args


def multinode_env(environ: dict = os.environ) -> dict[str, str]:
    """The multi-node variables, checked; a missing or malformed one stops with what to set."""
    missing = [f"  {k}: {why}" for k, why in MULTINODE_ENV.items() if not environ.get(k)]
    if missing:
        raise ApplianceError("multi-node launch: set these environment variables on every node:\n"
                             + "\n".join(missing))
    env = {k: environ[k] for k in MULTINODE_ENV}
    for k in ("MASTER_PORT", "NNODES", "NODE_RANK"):
        if not env[k].isdigit():
            raise ApplianceError(f"multi-node launch: {k}={env[k]!r} must be a number")
    if int(env["NODE_RANK"]) >= int(env["NNODES"]):
        raise ApplianceError(f"multi-node launch: NODE_RANK={env['NODE_RANK']} must be < "
                             f"NNODES={env['NNODES']}")
    env["RUN_ID"] = environ.get("RUN_ID") or "pithtrain"  # the same on every node of one job
    return env


def compose(file: str, service: str, env: dict[str, str], cmd: list[str] | None = None) -> str:
    """`docker compose run` of one service as a shell line; the compose file owns every container
    setting (GPUs, ipc, ulimits, volumes), so tasks.py never repeats them."""
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    line = f"docker compose -f compose/{file} run --rm {service}"
    return f"{prefix} {line}" + (" " + shlex.join(cmd) if cmd else "")


def ensure_image(target: str, pins: dict) -> str:
    """Reuse the pinned image when present, else build it, as one shell line."""
    return (f"docker image inspect {image_name(target, pins)} >/dev/null 2>&1 || "
            + shlex.join(build_command(target, pins)))


# ---------------------------------------------------------------------------------------------
# Manifest and drift


def _run_out(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def collect_manifest() -> dict:
    """What this environment has, in the shape `drift` compares. The image build stores it at
    /etc/pithtrain/manifest.json; the build args it recorded come back through ENV."""
    from importlib import metadata

    nvcc = re.search(r"V(\d+\.\d+\.\d+)", _run_out(["nvcc", "--version"]))
    nsys = re.search(r"(\d{4}\.\d+\.\d+[\d.]*)", _run_out(["nsys", "--version"]))
    try:
        import torch
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # no torch, or a CPU build without NCCL
        nccl = None
    env = os.environ.get
    return {
        "target": env("PITHTRAIN_TARGET"), "base_image": env("PITHTRAIN_BASE_IMAGE"),
        "python": ".".join(map(str, sys.version_info[:3])), "cuda": env("CUDA_VERSION"),
        "nvcc": nvcc and nvcc.group(1), "nsys": nsys and nsys.group(1), "nccl_runtime": nccl,
        "driver_min": env("PITHTRAIN_DRIVER_MIN"),
        "packages": {_canon(d.metadata["Name"]): d.version for d in metadata.distributions()},
    }


def deepgemm_build(pins: dict) -> str:
    """The local version label images/build_deepgemm.sh stamps on DeepGEMM: the commit and each
    upstream fix, 7 hex digits each, dot-joined (2.1.1+c9f8b34.f63d7f2...)."""
    return ".".join(c[:7] for c in [pins["deepgemm_commit"], *pins.get("deepgemm_patches", "").split()])


def _local(label: str) -> str:
    """A PEP 440 local label as installers normalise it: all-digit segments lose leading zeros."""
    return ".".join(str(int(x)) if x.isdigit() else x.lower() for x in re.split(r"[._-]", label))


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _same(pin: str, got) -> bool:
    """'2.11.0' matches '2.11.0', '2.11.0+cu130'; '3.12' matches '3.12.3'; '2025.5.2' '2025.5.2.266'."""
    if got is None:
        return False
    got = str(got).split("+")[0]
    return got == pin or got.startswith(pin + ".")


def drift(manifest: dict, target: str, pins: dict) -> list[str]:
    """Every difference between a manifest (or a live environment) and versions.yaml's target."""
    want = {"target": target, "base_image": base_ref(pins), "python": pins["python"],
            "cuda": pins["cuda"], "nsys": pins["nsys"], "nccl_runtime": pins["nccl"],
            "driver_min": pins["driver_min"]}
    out = [f"{k}: versions.yaml pins {v}, found {manifest.get(k)}"
           for k, v in want.items() if not _same(v, manifest.get(k))]
    packages = manifest.get("packages") or {}
    if "deepgemm_commit" in pins:  # the installed distribution's version names its build
        dg, stamp = packages.get("deep-gemm"), deepgemm_build(pins)
        if dg is None or _local(str(dg).partition("+")[2]) != _local(stamp):
            out.append(f"deep-gemm: versions.yaml pins the build {stamp}, found {dg}")
    for req in pip_pins(pins):
        name, version = req.split("==")
        name = _canon(name.split("[")[0])
        if not _same(version, packages.get(name)):
            out.append(f"pip {name}: versions.yaml pins {version}, found {packages.get(name)}")
    return out


# The kernel packages a target pins -> the module to import (doctor's live check), and how the
# framework loads a module where a plain import is not how it runs: DeepGEMM through
# kernels/deepgemm.load, which puts libstdc++ in the global scope first (a plain import segfaults).
KERNEL_MODULES = {"flash_attn_4": "flash_attn.cute", "deepgemm_commit": "deep_gemm"}
LOADERS = {"deep_gemm": "from pithtrain.kernels.deepgemm import load; why = []; assert load(why), why"}


def import_problems(pins: dict, modules: dict = KERNEL_MODULES) -> list[str]:
    """Import each kernel package the target pins as the framework loads it (LOADERS), each in a
    fresh interpreter: a package that installs but does not load (a missing native library, a crash
    in its load order, issue #22) is reported, and a crash does not end the check."""
    out = []
    for key, module in modules.items():
        if key not in pins:
            continue
        code = LOADERS.get(module, f"import {module}")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        if r.returncode:
            why = f"killed by signal {-r.returncode}" if r.returncode < 0 else f"exit {r.returncode}"
            last = (r.stderr.strip().splitlines() or [""])[-1]
            out.append(f"import {module}: failed ({why}){': ' + last if last else ''}")
    return out


def driver_problem(driver: str, driver_min: str) -> str | None:
    have, need = ([int(x) for x in v.split(".")] for v in (driver, driver_min))
    if have < need:
        return f"NVIDIA driver {driver} is older than {driver_min}, the minimum for this image's CUDA"
    return None


# ---------------------------------------------------------------------------------------------
# Version literals outside versions.yaml

# A version-looking literal: a pip specifier's dotted version (torch==2.11.0), a number with three
# or more dotted parts, a two-part number right after a component name (python3.12, CUDA 13.0,
# torch 2.11), a git commit or an image digest.
_VERSION_PATTERNS = [
    re.compile(r"(?<=[\w\]])(?:==|>=|<=|~=|!=)v?(\d+(?:\.\d+)+[\w.]*)"),  # name==1.2, not `x == 0`
    re.compile(r"(?<![\w.])v?(\d+\.\d+\.\d+[\w.]*)"),
    re.compile(r"(?i)(?<![a-z])(?:python|py|cuda|cu|torch|pytorch|triton|nccl|cudnn|nsys|"
               r"nsight-systems|ubuntu|flash-attn|fa|deepgemm|transformers)[-_ :=v]*(\d+\.\d+[\w.]*)"),
    re.compile(r"(?<![0-9a-f])([0-9a-f]{40})(?![0-9a-f])"),
    re.compile(r"(sha256:[0-9a-f]{64})"),
]
# Private, loopback and unspecified IPv4 addresses (example MASTER_ADDRs) are not versions.
_ADDRESS = re.compile(r"(?:10|127|0|192\.168|172\.(?:1[6-9]|2\d|3[01]))(?:\.\d{1,3}){2,3}")


def version_literals(text: str) -> set[str]:
    found = set()
    for pattern in _VERSION_PATTERNS:
        found.update(m.group(1).rstrip(".") for m in pattern.finditer(text))
    return {v for v in found if not (_ADDRESS.fullmatch(v) and v.count(".") == 3)}


def pinned_values(versions: dict) -> set[str]:
    """Every pin in versions.yaml and the version literals inside them (13.0.2 in a base tag)."""
    values = set()
    for pins in versions["targets"].values():
        for v in list(pins.values()) + list(pins["python_packages"].values()):
            if isinstance(v, str):
                values.add(v)
                values |= version_literals(v)
    return values


def find_unpinned_versions(paths, versions: dict, allowed: set[str] | None = None) -> list[str]:
    """'file:line: literal' for each version-looking literal not taken from versions.yaml.

    `allowed` defaults to the pins themselves, which suits prose (a skill may say "torch 2.11.0"
    while the image has it); pass an empty set for files that must name no version at all
    (Dockerfiles, compose, SkyPilot: they get versions through build args and the image name)."""
    if allowed is None:  # prose: a pin, or its release series ("CUDA 13.0" for 13.0.2)
        pins = pinned_values(versions)
        allowed = pins | {".".join(p.split(".")[:n]) for p in pins for n in (2, 3)}
    out = []
    for path in paths:
        for n, line in enumerate(Path(path).read_text().splitlines(), 1):
            for lit in sorted(version_literals(line) - allowed):
                out.append(f"{path}:{n}: {lit}")
    return out


# ---------------------------------------------------------------------------------------------
# Small checks used by tasks


def check_loss(metrics_jsonl: str | Path, window: int = 5) -> tuple[bool, str]:
    """PASS when every logged loss is finite and the last `window` losses average lower than
    the first `window` (a short run from random init must learn something)."""
    losses = [json.loads(line)["loss"] for line in Path(metrics_jsonl).read_text().splitlines()
              if line.strip()]
    if len(losses) < 2 * window:
        return False, f"FAIL: {len(losses)} logged steps, need {2 * window} (log.every=1)"
    if not all(math.isfinite(x) for x in losses):
        return False, f"FAIL: non-finite loss in {metrics_jsonl}"
    first, last = sum(losses[:window]) / window, sum(losses[-window:]) / window
    ok = last < first
    verdict = "PASS" if ok else "FAIL"
    return ok, f"{verdict}: mean loss first {window} {first:.4f} -> last {window} {last:.4f}"


def code_lines(source: str) -> int:
    """Python lines that are code: not blank, not a comment, not part of a docstring (the unit of
    the package's size budget, AGENTS.md rule 9)."""
    import ast

    docs = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body:
            first = body[0]
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                docs.update(range(first.lineno, first.end_lineno + 1))
    return sum(1 for i, line in enumerate(source.splitlines(), 1)
               if i not in docs and line.strip() and not line.lstrip().startswith("#"))


def count_lines(root: str | Path) -> dict[str, int]:
    """Code lines (`code_lines`) per folder under root: the growth budget."""
    counts: dict[str, int] = {}
    for f in sorted(Path(root).rglob("*.py")):
        key = str(f.parent.relative_to(Path(root).parent))
        counts[key] = counts.get(key, 0) + code_lines(f.read_text())
    return counts


def run_torchrun(argv: list[str]) -> int:
    """torchrun (torch.distributed.run) that ends in the ranks' own words: a signal it passed on,
    or a rank that failed, ends it with that code (a notice 128 + its number, a config error 2)
    and without its traceback and failure table; the ranks said what happened (rank 0 a config
    error, the stop line of a notice). A rank killed by a signal, which says nothing, gets a line."""
    import signal

    def early(*_):  # Ctrl-C while torch loads: no rank has started
        print("torchrun: stopped by SIGINT before the ranks started; nothing saved", file=sys.stderr)
        raise SystemExit(130)

    signal.signal(signal.SIGINT, early)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    signal.signal(signal.SIGINT, signal.default_int_handler)  # the agent installs its own
    try:
        run(parse_args(argv))
    except SignalException as e:
        return 128 + e.sigval
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        if failure.exitcode >= 0:
            return failure.exitcode
        print(f"torchrun: rank {rank} ({failure.hostname}, pid {failure.pid}) was killed by "
              f"{failure.signal_name()}", file=sys.stderr)
        return 128 - failure.exitcode
    return 0


# ---------------------------------------------------------------------------------------------
# Entry point


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m tools.appliance", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("manifest", help="write this environment's manifest (the image build runs it)")
    m.add_argument("--out", default=str(MANIFEST))
    c = sub.add_parser("check-loss", help="PASS/FAIL on a metrics.jsonl: finite and decreasing")
    c.add_argument("metrics")
    sub.add_parser("torchrun", help="torchrun ARGS..., ending with the failed rank's code and no traceback "
                   "(invoke train's and launch's native launcher)")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["torchrun"]:  # every later argument is torchrun's
        return run_torchrun(argv[1:])
    args = p.parse_args(argv)
    if args.cmd == "manifest":
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(collect_manifest(), indent=1, sort_keys=True) + "\n")
        print(f"wrote {args.out}")
        return 0
    ok, msg = check_loss(args.metrics)
    print(msg)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
