"""Distributed training: PP x DP x FSDP x CP, with EP borrowed from a stage's ranks (files: AGENTS.md)."""
