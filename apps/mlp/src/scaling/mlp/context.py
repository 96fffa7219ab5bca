"""MLPContext: the trainer's BaseContext holding the MLP config."""

from __future__ import annotations

from scaling.mlp.config import MLPConfig
from scaling.trainer import BaseContext


class MLPContext(BaseContext[MLPConfig]):
    """Topology, config and counters of an MLP run."""
