"""scaling.nn: parallel layers, LayerSpec, ParameterMeta, LoRA and checkpointing."""

from scaling.nn._meta import ParameterMeta, get_parameter_meta

__all__ = ["ParameterMeta", "get_parameter_meta"]
