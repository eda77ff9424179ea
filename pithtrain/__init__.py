"""PithTrain: a compact, Python-native training system for Mixture-of-Experts language models."""

__version__ = "0.1.0"


class ConfigError(ValueError):
    """A recipe problem, phrased for a person: '<file>: <key>: <what is allowed>' (pithtrain.config)."""
