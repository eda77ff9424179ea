"""A variant's switch in the layout, pipeline and resume tests: `validate.py --set model.X=V`.

validate.py puts its model.* overrides in PITHTRAIN_TEST_SET (one `model.key=value` a line) and a
file path in PITHTRAIN_TEST_SET_LOG. The tests' config builders pass their model fields through
`model()` (or add `overrides(base)` to a load_config list). The switch goes only into a config
that admits it: the test's config with the switch on is checked as a recipe is (the field must
exist in the family, the family's `validate` must accept the values, e.g. a variant that needs an
even num_kv_heads refuses a config with one), and a config that refuses it runs with the switch
off. Each decision appends a line to the log naming the running test (PYTEST_CURRENT_TEST,
inherited by spawned ranks): `took<TAB>test`, or `off<TAB>test<TAB>why` with the config's error,
so validate.py reports which tests ran with the switch and which did not, and why.
Unset, nothing changes.
"""

from __future__ import annotations

import copy
import dataclasses
import os

ENV, LOG = "PITHTRAIN_TEST_SET", "PITHTRAIN_TEST_SET_LOG"


def switches() -> list[str]:
    return [s.strip() for s in os.environ.get(ENV, "").splitlines() if s.strip()]


def admits(raw: dict, sets: list[str], cross_checks: bool = True) -> dict | None:
    """`raw` (a recipe dict) with `sets` applied, if the config it makes is valid; else None. Logged."""
    from pithtrain.config import ConfigError, apply_override, config_from_dict
    from pithtrain.models import FAMILIES
    raw = copy.deepcopy(raw)
    cls = FAMILIES[raw.get("model", {}).get("family", "qwen3_moe")].config
    missing = [s.split("=", 1)[0] for s in sets if s.split("=", 1)[0].removeprefix("model.")
               not in {f.name for f in dataclasses.fields(cls)}]
    if missing:
        record("off", f"{cls.__name__} has no field {', '.join(missing)}")
        return None
    try:
        for s in sets:
            apply_override(raw, s)
        config_from_dict(raw, "the test's config", cross_checks)
    except ConfigError as e:  # e.key / e.detail: the refusal without the source's name
        record("off", f"{e.key}: {e.detail}" if hasattr(e, "key") else str(e))
        return None
    record("took")
    return raw


def record(outcome: str, why: str = "") -> None:
    if os.environ.get(LOG):
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" (", 1)[0]
        with open(os.environ[LOG], "a") as f:  # one short line per call: appends from ranks interleave whole
            f.write("\t".join([outcome, test, " ".join(why.split())]).rstrip("\t") + "\n")


def overrides(base: list[str] = ()) -> list[str]:
    """The switch as load_config overrides, when the config of load_config(None, base + switch)
    admits it; else []."""
    from pithtrain.config import load_config
    sets = switches()
    return sets if sets and admits(load_config(None, list(base)).to_dict(), sets) else []


def model(fields: dict, family: str | None = None) -> dict:
    """A model section (`fields`; family from `family`, else its "family" key) with the switch on,
    when that family's config of these fields admits it; else `fields` as they are."""
    sets = switches()
    fam = family or fields.get("family", "qwen3_moe")
    on = sets and admits({"model": {**fields, "family": fam}}, sets, cross_checks=False)
    if not on:
        return dict(fields)
    return {k: v for k, v in on["model"].items() if k != "family" or "family" in fields}
