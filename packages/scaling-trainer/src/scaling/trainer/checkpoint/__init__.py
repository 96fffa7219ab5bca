"""scaling.trainer.checkpoint: atomic, verified, layout-independent checkpoints through DCP."""

from scaling.trainer.checkpoint._errors import CheckpointError
from scaling.trainer.checkpoint._load import LoadedCheckpoint, load_checkpoint
from scaling.trainer.checkpoint._marker import committed_steps
from scaling.trainer.checkpoint._model_state import load_model_state_dict, model_state_dict
from scaling.trainer.checkpoint._save import PendingSave, StagingBuffers, new_checkpoint_group, save_checkpoint

__all__ = [
    "CheckpointError",
    "LoadedCheckpoint",
    "PendingSave",
    "StagingBuffers",
    "committed_steps",
    "load_checkpoint",
    "load_model_state_dict",
    "model_state_dict",
    "new_checkpoint_group",
    "save_checkpoint",
]
