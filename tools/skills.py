"""Skills (skills/<name>/SKILL.md): lint them, and check one skill's prerequisites before it runs.

    python -m tools.skills check validate-correctness   # or: invoke doctor --skill validate-correctness
    python -m tools.skills lint                          # every skill; what tests/test_skills.py runs
    python tools/skills.py                               # the same lint, from a path

A SKILL.md opens with YAML front matter (the Agent Skills format plus one key of ours):

    name: validate-correctness          # equals the folder name
    description: Use when ...           # when to use it
    prerequisites:
      versions: [torch]                 # pins it relies on: a key under every target of
                                        # images/versions.yaml, or a full path (targets.hopper.nsys)
      commands: [git]                   # executables that must be on PATH
      modules: [torch]                  # Python modules that must be importable
      optional: [nsys]                  # executables used when present; reported, never required

`lint` is static (runs anywhere, CI): front matter, name, description, body length, the doctor step,
referenced files, test files and globs (each must match a file in tests/), cited documents (any *.md)
and AGENTS.md rule numbers, and that every `versions` key exists in versions.yaml, so renaming a pin
without updating the skills fails. `check` is the runtime half: the same keys plus PATH and imports here.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

if __package__ in (None, ""):  # run as `python tools/skills.py`: the repository root is not on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tools.appliance import VERSIONS, find_unpinned_versions, load_versions, pinned_values

ROOT = Path(__file__).resolve().parent.parent
SKILLS_DIR = ROOT / "skills"

MAX_BODY_LINES = 500
NAME_RE = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")  # Agent Skills: lowercase, digits, single hyphens
FRONT_KEYS = {"name", "description", "license", "compatibility", "allowed-tools", "metadata",
              "prerequisites"}
PREREQ_KINDS = ("versions", "commands", "modules", "optional")
# Repo paths a skill names in backticks, e.g. `pithtrain/train.py` or `scripts/validate.py`.
PATH_RE = re.compile(r"`((?:scripts|pithtrain|tests|skills|images|compose|docs)/[\w./-]*"
                     r"|tasks\.py|AGENTS\.md|README\.md|pyproject\.toml)`")
# Any Markdown file a skill names, in backticks or not: a cited document must be in the repository.
MD_RE = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[\w-]+\.md)\b")
# A test file or glob under tests/ (`tests/test_moe.py`, test_pipeline*.py): it must match a file.
TEST_RE = re.compile(r"(?<![\w<])test_[\w*]+\.py")
# "AGENTS.md, rules 1 to 4" / "`AGENTS.md`, rule 7": the numbers must be rules AGENTS.md has.
RULES_RE = re.compile(r"AGENTS\.md`?,? rules? (\d+(?:(?:,| and| to| or) \d+)*)")


@dataclass
class Skill:
    name: str
    description: str
    prerequisites: dict  # kind -> list of strings (PREREQ_KINDS)
    body: str
    dir: Path


def parse(skill_md: Path) -> Skill:
    """Split front matter from body; raise ValueError naming the file when it is not parseable."""
    text = skill_md.read_text()
    m = re.match(r"^---\n(.*?)\n---\n(.*)$", text, re.S)
    if not m:
        raise ValueError(f"{skill_md}: no YAML front matter (the file must open with '---')")
    try:
        front = yaml.safe_load(m[1])
    except yaml.YAMLError as e:
        raise ValueError(f"{skill_md}: front matter is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(front, dict):
        raise ValueError(f"{skill_md}: front matter must be a mapping")
    unknown = set(front) - FRONT_KEYS
    if unknown:
        raise ValueError(f"{skill_md}: unknown front-matter keys {sorted(unknown)} (allowed: {sorted(FRONT_KEYS)})")
    prereq = front.get("prerequisites") or {}
    if not isinstance(prereq, dict) or set(prereq) - set(PREREQ_KINDS):
        raise ValueError(f"{skill_md}: prerequisites must be a mapping with keys from {PREREQ_KINDS}")
    for kind, items in prereq.items():
        if not isinstance(items, list) or not all(isinstance(i, str) and i for i in items):
            raise ValueError(f"{skill_md}: prerequisites.{kind} must be a list of non-empty strings")
    return Skill(name=str(front.get("name", "")), description=str(front.get("description") or ""),
                 prerequisites={k: list(prereq.get(k, [])) for k in PREREQ_KINDS},
                 body=m[2], dir=skill_md.parent)


def _get(node, dotted: str):
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def lookup(versions: dict, key: str) -> dict[str, object]:
    """{full key: value} for a prerequisite key: 'targets.hopper.nsys' names one pin; a short key
    ('torch', 'python_packages.transformers') names that pin in every target. None: missing."""
    if key.startswith("targets."):
        return {key: _get(versions, key)}
    return {f"targets.{t}.{key}": _get(pins, key) for t, pins in versions["targets"].items()}


# ---------------------------------------------------------------------------------------------
# Lint (static) and check (this machine)


def lint(skill_dir: Path, versions: dict) -> list[str]:
    """Problems with one skill folder; empty when it is well-formed and consistent with the pins."""
    md = skill_dir / "SKILL.md"
    if not md.is_file():
        return [f"{skill_dir}: no SKILL.md"]
    try:
        s = parse(md)
    except ValueError as e:
        return [str(e)]
    problems = []
    if s.name != skill_dir.name:
        problems.append(f"{md}: name {s.name!r} must equal the folder name {skill_dir.name!r}")
    if not NAME_RE.fullmatch(s.name) or len(s.name) > 64:
        problems.append(f"{md}: name {s.name!r}: lowercase letters, digits and single hyphens, <= 64 chars")
    if not s.description.strip() or len(s.description) > 1024:
        problems.append(f"{md}: description must say when to use the skill (1..1024 characters)")
    n_lines = len(s.body.splitlines())
    if n_lines >= MAX_BODY_LINES:
        problems.append(f"{md}: body has {n_lines} lines (keep it under {MAX_BODY_LINES})")
    if f"invoke doctor --skill {skill_dir.name}" not in s.body:
        problems.append(f"{md}: the first step must run `invoke doctor --skill {skill_dir.name}`")
    for key in s.prerequisites["versions"]:
        for full, value in lookup(versions, key).items():
            if value is None:
                problems.append(f"{md}: prerequisite {key!r}: {full} is not in images/versions.yaml")
    for ref in sorted(set(PATH_RE.findall(s.body))):
        if not ((skill_dir / ref).exists() or (ROOT / ref).exists()):
            problems.append(f"{md}: names `{ref}`, which does not exist")
    for ref in sorted(set(MD_RE.findall(s.body))):
        if not ((skill_dir / ref).exists() or (ROOT / ref).exists()):
            problems.append(f"{md}: cites {ref}, which is not in the repository (the rules are AGENTS.md's)")
    n_rules = len(re.findall(r"(?m)^\d+\. ", _section(ROOT / "AGENTS.md", "## Rules every change keeps")))
    for numbers in RULES_RE.findall(s.body):
        for n in map(int, re.findall(r"\d+", numbers)):
            if not 1 <= n <= n_rules:
                problems.append(f"{md}: cites AGENTS.md rule {n}; it has rules 1 to {n_rules}")
    scripts = sorted(p for p in (skill_dir / "scripts").glob("*") if p.is_file())
    if not scripts:
        problems.append(f"{skill_dir}: no scripts/ (every skill ends in a PASS/FAIL script)")
    for f in [md, *scripts]:  # SKILL.md may name a test the playbook has you write, but not a glob
        for ref in sorted(set(TEST_RE.findall(f.read_text()))):
            if (f != md or "*" in ref) and not any((ROOT / "tests").glob(ref)):
                problems.append(f"{f}: names {ref}, which matches no file in tests/")
    # No version literal at all: a pin's value is named by its key (ours), and a version-looking
    # literal that is not a pin is drift (the appliance's checker, which also scans Dockerfiles).
    literals = {v for v in pinned_values(versions)  # versions and commits, not names like linux/amd64
                if re.fullmatch(r"v?\d+\.\d+[\w.+-]*", v) or re.fullmatch(r"[0-9a-f]{12,64}", v)}
    for f in [md, *scripts]:
        text = f.read_text()
        for v in sorted(literals):
            if re.search(rf"(?<![\w.]){re.escape(v)}(?![\w])", text):
                problems.append(f"{f}: version literal {v!r}; refer to its images/versions.yaml key")
    problems += [f"{hit}: version literal not from images/versions.yaml"
                 for hit in find_unpinned_versions([md, *scripts], versions)]
    return problems


def _section(path: Path, heading: str) -> str:
    """The text under `heading` up to the next heading of any level; empty when absent."""
    text = path.read_text() if path.is_file() else ""
    start = text.find(heading + "\n")
    if start < 0:
        return ""
    rest = text[start + len(heading) + 1:]
    m = re.search(r"(?m)^#", rest)
    return rest[:m.start()] if m else rest


def lint_all(skills_dir: Path = SKILLS_DIR, versions_path: Path = VERSIONS) -> list[str]:
    versions = load_versions(versions_path)
    dirs = sorted(p for p in skills_dir.iterdir() if p.is_dir())
    if not dirs:
        return [f"{skills_dir}: no skills"]
    return [p for d in dirs for p in lint(d, versions)]


def check(name: str, skills_dir: Path = SKILLS_DIR, versions_path: Path = VERSIONS) -> list[tuple[str, bool, str]]:
    """(item, ok, detail) for every prerequisite of skill `name` on this machine."""
    md = skills_dir / name / "SKILL.md"
    if not md.is_file():
        known = ", ".join(sorted(p.name for p in skills_dir.iterdir() if (p / "SKILL.md").is_file()))
        return [(f"skill {name}", False, f"no such skill (skills: {known})")]
    try:
        s = parse(md)
    except ValueError as e:  # broken front matter: one failed row, as lint reports it, not a traceback
        return [(f"skill {name}", False, str(e))]
    versions = load_versions(versions_path)
    rows = []
    for key in s.prerequisites["versions"]:
        for full, value in lookup(versions, key).items():
            rows.append((f"pin {full}", value is not None,
                         "missing from images/versions.yaml" if value is None else str(value)))
    for cmd in s.prerequisites["commands"]:
        path = shutil.which(cmd)
        rows.append((f"command {cmd}", path is not None, path or "not on PATH"))
    for mod in s.prerequisites["modules"]:
        found = importlib.util.find_spec(mod) is not None
        rows.append((f"module {mod}", found, "importable" if found else "not importable"))
    for cmd in s.prerequisites["optional"]:
        path = shutil.which(cmd)
        rows.append((f"optional {cmd}", True, path or "absent (the skill uses its fallback)"))
    return rows


def report(name: str, **kw) -> bool:
    """Print the prerequisite table for skill `name`; True when every required item is present."""
    rows = check(name, **kw)
    for item, ok, detail in rows:
        print(f"  {'ok  ' if ok else 'MISS'} {item:<52} {detail}")
    ok = all(r[1] for r in rows)
    print(f"skill {name}: prerequisites {'PASS' if ok else 'FAIL'}")
    return ok


# ---------------------------------------------------------------------------------------------
# Entry point


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.skills", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.set_defaults(cmd="lint", versions=VERSIONS, skills_dir=SKILLS_DIR)  # no command: lint
    sub = p.add_subparsers(dest="cmd")
    c = sub.add_parser("check", help="check one skill's prerequisites on this machine")
    c.add_argument("name")
    lt = sub.add_parser("lint", help="lint every skill against images/versions.yaml")
    for q in (c, lt):
        q.add_argument("--versions", type=Path, default=VERSIONS, help="versions file to check against")
        q.add_argument("--skills-dir", type=Path, default=SKILLS_DIR, help="folder holding the skills")
    args = p.parse_args(argv)
    if args.cmd == "check":
        return 0 if report(args.name, skills_dir=args.skills_dir, versions_path=args.versions) else 1
    problems = lint_all(args.skills_dir, args.versions)
    for line in problems:
        print(line)
    print("FAIL" if problems else "PASS")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
