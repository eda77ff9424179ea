"""Checkpoints: Hugging Face import/export (hf.py)."""

from pithtrain.checkpoint.hf import load_hf, save_hf

__all__ = ["load_hf", "save_hf"]
