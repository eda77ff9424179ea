"""PithTrain: a compact, Python-native training system for Mixture-of-Experts language models."""

__version__ = "0.1.0"


class ConfigError(ValueError):
    """A recipe problem, phrased for a person: '<file>: <key>: <what is allowed>' (pithtrain.config)."""


def check(section, err, keys: str, ok, want: str):
    """err(key, "must be WANT, got V") for each of `keys` (space-separated) whose value is set and
    fails `ok`. Write `ok` so that nan fails too (every comparison with nan is false). The recipe's
    sections (config.py) and the model families' validate use it."""
    for k in keys.split():
        if getattr(section, k) is not None and not ok(getattr(section, k)):
            err(k, f"must be {want}, got {getattr(section, k)}")
