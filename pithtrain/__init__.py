"""PithTrain: a compact, Python-native training system for Mixture-of-Experts language models."""

__version__ = "0.1.0"
