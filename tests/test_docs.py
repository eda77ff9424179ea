"""The documents stand alone and agree with the tree: no citation of a file outside the repository,
AGENTS.md's map names every module, CI runs exactly the README's Quick start, and the memory-plan
tables of docs/parallelism.md are what `python -m pithtrain.plan` prints."""

import re
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Documents that live outside the repository: the sibling shared/ folder and its BENCH/STYLE/DESIGN.
OUTSIDE_RE = re.compile(r"\bshared/|\b(?:BENCH|STYLE|DESIGN)\.md\b|\bDESIGN/STYLE\b")


def repo_files(*paths: str) -> list[str]:
    """Tracked and new (not ignored) files under `paths`, as git lists them."""
    r = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", *paths],
                       cwd=ROOT, capture_output=True, text=True, check=True)
    return sorted(set(r.stdout.split()))


@pytest.mark.quick  # cheap, and a doc edit's inner loop
def test_docs_and_code_cite_only_the_repository():
    files = repo_files("pithtrain", "tools", "scripts", "skills", "docs", "tasks.py", "README.md", "AGENTS.md")
    assert "pithtrain/bench.py" in files and "README.md" in files
    hits = [f"{f}:{n}: {line.strip()}" for f in files if not f.endswith(".json")
            for n, line in enumerate((ROOT / f).read_text().splitlines(), 1) if OUTSIDE_RE.search(line)]
    assert hits == [], "cite docs/bench.md or AGENTS.md's rules instead:\n" + "\n".join(hits)


@pytest.mark.quick  # cheap, and a doc edit's inner loop
def test_agents_md_maps_every_module_and_document():
    text = (ROOT / "AGENTS.md").read_text()
    files = [f for f in repo_files("pithtrain", "docs")
             if (f.endswith(".py") and not f.endswith("__init__.py")) or f.endswith(".md")]
    assert "pithtrain/train.py" in files and "docs/bench.md" in files
    assert [f for f in files if f"`{f}`" not in text] == []


def resolves(name: str) -> bool:
    """`name` is a module's attribute path: its longest prefix that is a module (a file of the
    repository, or torch's), imported, then getattr. A repository module that needs a package
    missing here (Triton on CPU) is read instead: each name defined in its body (a class, then its
    method)."""
    import ast
    import importlib

    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        mod, path = ".".join(parts[:cut]), ROOT.joinpath(*parts[:cut])
        file = path.with_suffix(".py") if path.with_suffix(".py").is_file() else path / "__init__.py"
        if parts[0] != "torch" and not file.is_file():
            continue
        try:
            obj = importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if parts[0] == "torch" and name.startswith(e.name):  # not a module: a shorter prefix is
                continue
            body = ast.parse(file.read_text()).body
            for attr in parts[cut:]:
                node = next((n for n in body if getattr(n, "name", None) == attr), None)
                if node is None:
                    return False
                body = getattr(node, "body", [])
            return True
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


@pytest.mark.quick  # cheap, and a doc edit's inner loop
def test_the_run_path_names_only_functions_that_exist(monkeypatch):
    """docs/run-path.md: every `module.function` (or `module.Class.method`) it names imports and
    resolves, so the path of a run cannot drift from the code unnoticed."""
    monkeypatch.syspath_prepend(str(ROOT))  # tasks.py and tools/ live at the root
    text = (ROOT / "docs" / "run-path.md").read_text()
    names = re.findall(r"`((?:pithtrain|tasks|tools|torch)\.[\w.]+)`", text)
    assert len(names) > 50 and "pithtrain.kernels.fa4.fa4_fwd" in names
    assert not resolves("pithtrain.models.common.GroupedExperts.no_such_method")
    assert [n for n in names if not resolves(n)] == []


@pytest.mark.quick  # cheap, and a doc edit's inner loop
def test_readme_is_a_front_page_that_points_at_every_doc():
    """At most 250 lines (the manual is docs/, one file per concern), and every docs file is named."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    assert [f for f in repo_files("docs") if f.endswith(".md") and f"`{f}`" not in readme] == []


@pytest.mark.quick  # cheap, and a doc edit's inner loop
def test_ci_runs_exactly_the_readme_quick_start():
    readme = (ROOT / "README.md").read_text()
    quick = re.search(r"^## Quick start\n\n```bash\n(.*?)^```", readme, re.S | re.M)[1].splitlines()
    assert quick == ["pip install -e '.[dev]' && invoke train", "invoke test"]
    ci = [ln for ln in (ROOT / ".ci" / "run").read_text().splitlines()
          if ln and not ln.startswith(("#", "set ", "cd "))]
    want = [c for ln in quick for c in ln.split(" && ")]  # one a line: set -e skips && lists
    assert ci == [*want[:-1], "invoke test --quick", want[-1]]  # the quick tier's time in CI's log too


# ---------------------------------------------------------------------------------------------
# Every path and command the documents name exists. docs/perf-notes.md is the lab notebook: each
# entry names the commit it ran at, so what it cites may since have gone (deleted probes).

DOCS = ["README.md", "AGENTS.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")
                                          if p.name != "perf-notes.md")]
# A path: a/b.ext or a known top folder with anything under it; a bare name only for code and
# documents (meta.json, config.json, my.yaml are files a run writes or a user names).
PATH_RE = re.compile(r"^(?:\.ci/|[\w.-]+/)+[\w.-]+\.(?:py|md|yaml|yml|sh|json|toml|txt)$|^[\w.-]+\.(?:py|md)$|"
                     r"^(?:pithtrain|tests|scripts|docs|skills|images|compose|sky|tools|slurm)/[\w./-]*$")


def code_spans(text: str) -> list[str]:
    """Inline code and the lines of fenced blocks."""
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M)
    rest = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.S | re.M)
    return [ln for b in blocks for ln in b.splitlines()] + [" ".join(s.split()) for s in re.findall(r"`([^`]+)`", rest)]


@pytest.mark.quick  # cheap, and a doc edit's inner loop
def test_every_path_the_docs_name_exists():
    missing = []
    for doc in DOCS:
        for span in code_spans((ROOT / doc).read_text()):
            for word in span.split():
                word = word.strip("(),;:'\"").split("::")[0]
                if "<" in word or "*" in word or word.startswith(("runs/", "/")) or not PATH_RE.match(word):
                    continue
                if not any((base / word).exists() for base in (ROOT, ROOT / "pithtrain")):
                    missing.append(f"{doc}: {word}")
    assert missing == [], "named in the docs but not in the tree:\n" + "\n".join(missing)


def _task_options() -> dict[str, set[str]]:
    """invoke task name -> its --options, read from tasks.py's @task functions."""
    import ast

    tree = ast.parse((ROOT / "tasks.py").read_text())
    tasks = {}
    for fn in tree.body:
        if isinstance(fn, ast.FunctionDef) and any(
                getattr(d, "id", getattr(getattr(d, "func", None), "id", None)) == "task" for d in fn.decorator_list):
            args = [a.arg for a in fn.args.args[1:]]
            tasks[fn.name.replace("_", "-")] = {"--" + a.replace("_", "-") for a in args} | {"--help"}
            tasks[fn.name.replace("_", "-")] |= {"--no-" + a.replace("_", "-") for a in args}
    return tasks


def _module_file(module: str) -> Path | None:
    path = ROOT / (module.replace(".", "/") + ".py")
    return path if path.is_file() else ROOT / module.replace(".", "/") / "__main__.py"


@pytest.mark.quick  # cheap, and a doc edit's inner loop
def test_every_command_the_docs_show_exists_with_its_options():
    """`invoke TASK --opt`: the task and each option exist in tasks.py; `python -m pithtrain.X --opt`
    and `python path.py --opt`: the module or script exists and names the option."""
    tasks, bad = _task_options(), []
    for doc in DOCS:
        for span in code_spans((ROOT / doc).read_text()):
            for cmd in re.split(r"&&|\|\||;|\|", span.split(" #")[0]):
                try:
                    words = shlex.split(cmd)
                except ValueError:  # an unbalanced quote: a fragment, not a command
                    continue
                words = [w for w in words if not re.match(r"^[A-Z_]+=", w)]
                words = words[1:] if words[:1] == ["$"] else words
                if len(words) < 2:
                    continue
                # a quoted value is no option
                opts = [w.split("=")[0] for w in words[2:] if w.startswith("--") and " " not in w]
                if words[0] == "invoke" and not words[1].startswith("-"):
                    known = tasks.get(words[1])
                    if known is None:
                        bad.append(f"{doc}: `{cmd.strip()}`: no invoke task {words[1]!r}")
                    else:
                        bad += [f"{doc}: `{cmd.strip()}`: invoke {words[1]} has no {o}" for o in opts if o not in known]
                elif words[0] in ("python", "python3") and words[1] == "-m" and len(words) > 2:
                    if not words[2].startswith(("pithtrain", "tools")):
                        continue
                    src = _module_file(words[2])
                    if not src.is_file():
                        bad.append(f"{doc}: `{cmd.strip()}`: no module {words[2]}")
                        continue
                    text = src.read_text()
                    bad += [f"{doc}: `{cmd.strip()}`: {words[2]} has no {o}" for o in opts if o not in text]
                elif words[0] in ("python", "python3") and words[1].endswith(".py"):
                    src = ROOT / words[1]
                    if not src.is_file():
                        bad.append(f"{doc}: `{cmd.strip()}`: no script {words[1]}")
                        continue
                    bad += [f"{doc}: `{cmd.strip()}`: {words[1]} has no {o}" for o in opts if o not in src.read_text()]
    assert bad == [], "\n".join(bad)


# ---------------------------------------------------------------------------------------------
# docs/parallelism.md's tables: every row whose first cell is `--model ...` is run through
# `python -m pithtrain.plan ... --json` (its main, in this process) and each cell it quotes compared.


def _table_rows(text: str):
    """(header cells, row cells) of every markdown table row whose first cell quotes plan arguments."""
    header = None
    for line in text.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
        elif set(line) - set("|- ") and (m := re.match(r"`(--model [^`]+)`", cells[0])):
            yield header, cells, m[1]


def _plan_json(args: str) -> dict:
    import contextlib
    import io
    import json

    from pithtrain.plan import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        main([*shlex.split(args), "--json"])  # exit 1 for a plan that does not fit: its JSON is printed
    return json.loads(out.getvalue())


def _cell_problems(column: str, cell: str, r: dict, row: dict) -> list[str]:
    """What a cell of `column` says that the plan `r` does not (numbers as the cell rounds them)."""
    def num(x: float, text: str) -> bool:
        return text == f"{x:.{len(text.split('.')[1]) if '.' in text else 0}f}"

    nums = re.findall(r"\d+(?:\.\d+)?", cell)
    pred = r.get("prediction") or {}
    gib = 2 ** 30
    if "layout" in column:
        said = dict(re.findall(r"\b(pp|dp|fsdp|cp|ep)=(\d+)", cell))
        have = {k: str(v) for k, v in r["layout"].items() if v > 1}
        return [] if said == have or (cell.startswith("all 1") and not have) else [f"layout {have}"]
    if column.startswith("peak"):
        ok = num(r["peak_gib"], nums[0]) and (" of " not in cell or num(r["usable_gib"], nums[1]))
        return [] if ok else [f"peak {r['peak_gib']:.1f} of {r['usable_gib']:.1f}"]
    if column == "fits":
        return [] if cell == ("yes" if r["fits"] else "no") else [f"fits {r['fits']}"]
    if column.startswith("FSDP bytes"):
        t = r["ranks"][0]["fsdp_bytes_per_step"]
        ok = cell == "-" if not t["float32"] else num(t["float32"] / gib, nums[0]) and num(t["policy"] / gib, nums[1])
        return [] if ok else [f"FSDP {t['float32'] / gib:.1f} -> {t['policy'] / gib:.1f}"]
    if column.startswith("step s"):
        want = (pred["step_s"], pred["parts_s"]["compute"], pred["parts_s"]["all_to_all"])
        ok = all(num(x, t) for x, t in zip(want, nums, strict=True))
        return [] if ok else ["step {:.2f} ({:.2f} / {:.2f})".format(*want)]
    if column.startswith("predicted tokens/s"):
        return [] if num(pred["tokens_per_s_per_gpu"] / 1e3, nums[0]) else [
            f"predicted {pred['tokens_per_s_per_gpu'] / 1e3:.1f}K"]
    if column == "ratio":
        peer = float(re.findall(r"\d+(?:\.\d+)?", row["published peer"])[0])
        return [] if num(pred["tokens_per_s_per_gpu"] / 1e3 / peer, cell) else ["ratio"]
    return []


def test_parallelism_tables_are_what_the_plan_prints():
    """The memory-plan tables had drifted from the code (60.9 / 65.8 GiB where `invoke plan` said 67.0 /
    68.9; GPT-OSS on B200 fsdp=8 ep=8 80.3 GiB where it picked fsdp=8 ep=2 at 96.4)."""
    bad, rows = [], list(_table_rows((ROOT / "docs" / "parallelism.md").read_text()))
    assert len(rows) >= 16  # three tables
    for header, cells, args in rows:
        r, row = _plan_json(args), dict(zip(header, cells))
        bad += [f"`{args}` {col}: the doc says {cell!r}, the plan {p}" for col, cell in row.items()
                for p in _cell_problems(col, cell, r, row)]
    assert bad == [], "\n".join(bad)
