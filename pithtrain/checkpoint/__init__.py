"""Checkpoints: Hugging Face import/export (hf.py); sharded training checkpoints and resume (dcp.py)."""

from pithtrain.checkpoint.dcp import Checkpointer, CheckpointError
from pithtrain.checkpoint.hf import load_hf, save_hf

__all__ = ["load_hf", "save_hf", "Checkpointer", "CheckpointError"]
