"""scaling.trainer.checkpoint: atomic, verified, layout-independent checkpoints through DCP.

Torch's distributed checkpoint and DTensor (sympy with it: ~0.4 s of CPU) are imported when a
name that needs them is first used, not by ``import scaling.trainer``: a process that never
saves or loads (a launcher, a config check, a rank of a run without checkpoints) does without.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from scaling.trainer.checkpoint._errors import CheckpointError
from scaling.trainer.checkpoint._marker import committed_steps, delete_checkpoints

if TYPE_CHECKING:
    from scaling.trainer.checkpoint._load import LoadedCheckpoint, load_checkpoint
    from scaling.trainer.checkpoint._memory import MemoryCheckpoints
    from scaling.trainer.checkpoint._model_state import load_model_state_dict, model_state_dict
    from scaling.trainer.checkpoint._save import PendingSave, StagingBuffers, new_checkpoint_group, save_checkpoint

_LAZY = {
    "LoadedCheckpoint": "_load",
    "load_checkpoint": "_load",
    "MemoryCheckpoints": "_memory",
    "load_model_state_dict": "_model_state",
    "model_state_dict": "_model_state",
    "PendingSave": "_save",
    "StagingBuffers": "_save",
    "new_checkpoint_group": "_save",
    "save_checkpoint": "_save",
}


# Any: a module __getattr__ returns whichever name was asked for (mypy types each name
# from its definition; this is only the fallback for imports at run time).
def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value
    return value


__all__ = [
    "CheckpointError",
    "LoadedCheckpoint",
    "MemoryCheckpoints",
    "PendingSave",
    "StagingBuffers",
    "committed_steps",
    "delete_checkpoints",
    "load_checkpoint",
    "load_model_state_dict",
    "model_state_dict",
    "new_checkpoint_group",
    "save_checkpoint",
]
