"""The error raised for corrupt, incomplete, tampered or mismatching checkpoints."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint cannot be loaded: the message names the file or key and what to do."""
