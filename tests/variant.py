"""A variant's switch in the layout, pipeline and resume tests: `validate.py --set model.X=V`.

validate.py puts its model.* overrides in PITHTRAIN_TEST_SET (one `model.key=value` a line) and a
file path in PITHTRAIN_TEST_SET_LOG. The tests' config builders pass their model fields through
`model()` (or add `overrides()` to a load_config list): a family whose config has every named field
gets the switch, and the running test (PYTEST_CURRENT_TEST, inherited by spawned ranks) is appended
to the log, so validate.py reports exactly which tests ran with it. Unset, nothing changes.
"""

from __future__ import annotations

import dataclasses
import os

ENV, LOG = "PITHTRAIN_TEST_SET", "PITHTRAIN_TEST_SET_LOG"


def switches() -> list[str]:
    return [s.strip() for s in os.environ.get(ENV, "").splitlines() if s.strip()]


def overrides(family: str = "qwen3_moe") -> list[str]:
    """The switch as load_config overrides, when `family`'s config has every field it names; else []."""
    from pithtrain.models import FAMILIES
    sets = switches()
    names = {f.name for f in dataclasses.fields(FAMILIES[family].config)}
    if not sets or any(s.split("=", 1)[0].removeprefix("model.") not in names for s in sets):
        return []
    if os.environ.get(LOG):
        with open(os.environ[LOG], "a") as f:  # one short line per call: appends from ranks interleave whole
            f.write(os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" (", 1)[0] + "\n")
    return sets


def model(fields: dict, family: str | None = None) -> dict:
    """A model section (`fields`; family from `family`, else its "family" key) with the switch on."""
    from pithtrain.config import apply_override
    raw = {"model": dict(fields)}
    for s in overrides(family or fields.get("family", "qwen3_moe")):
        apply_override(raw, s)
    return raw["model"]
