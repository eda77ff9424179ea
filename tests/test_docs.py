"""The documents stand alone and agree with the tree: no citation of a file outside the repository,
AGENTS.md's map names every module, and CI runs exactly the README's Quick start."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Documents that live outside the repository: the sibling shared/ folder and its BENCH/STYLE/DESIGN.
OUTSIDE_RE = re.compile(r"\bshared/|\b(?:BENCH|STYLE|DESIGN)\.md\b|\bDESIGN/STYLE\b")


def repo_files(*paths: str) -> list[str]:
    """Tracked and new (not ignored) files under `paths`, as git lists them."""
    r = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", *paths],
                       cwd=ROOT, capture_output=True, text=True, check=True)
    return sorted(set(r.stdout.split()))


def test_docs_and_code_cite_only_the_repository():
    files = repo_files("pithtrain", "tools", "scripts", "skills", "docs", "tasks.py", "README.md", "AGENTS.md")
    assert "pithtrain/bench.py" in files and "README.md" in files
    hits = [f"{f}:{n}: {line.strip()}" for f in files if not f.endswith(".json")
            for n, line in enumerate((ROOT / f).read_text().splitlines(), 1) if OUTSIDE_RE.search(line)]
    assert hits == [], "cite docs/bench.md or AGENTS.md's rules instead:\n" + "\n".join(hits)


def test_agents_md_maps_every_module_and_document():
    text = (ROOT / "AGENTS.md").read_text()
    files = [f for f in repo_files("pithtrain", "docs")
             if (f.endswith(".py") and not f.endswith("__init__.py")) or f.endswith(".md")]
    assert "pithtrain/train.py" in files and "docs/bench.md" in files
    assert [f for f in files if f"`{f}`" not in text] == []


def test_ci_runs_exactly_the_readme_quick_start():
    readme = (ROOT / "README.md").read_text()
    quick = re.search(r"^## Quick start\n\n```bash\n(.*?)^```", readme, re.S | re.M)[1].splitlines()
    assert quick == ["pip install -e '.[dev]' && invoke train", "invoke test"]
    ci = [ln for ln in (ROOT / ".ci" / "run").read_text().splitlines()
          if ln and not ln.startswith(("#", "set ", "cd "))]
    assert ci == [c for ln in quick for c in ln.split(" && ")]  # one a line: set -e skips && lists
