"""scaling.transformer: GPT/Llama-style LLM trainer, generation and Hugging Face interop.

Names load on first use (PEP 562): ``scaling-transformer`` says what it does before torch,
which most of them need, has finished importing.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names, for type checkers and editors (__all__ exports them)
    from scaling.transformer.config import (
        BlendSourceConfig,
        FinetuningConfig,
        TrainingGroupConfig,
        TransformerArchitectureConfig,
        TransformerConfig,
    )
    from scaling.transformer.data import TransformerBatch, TransformerDataset
    from scaling.transformer.datasets import build_datasets
    from scaling.transformer.finetuning import apply_finetuning, training_groups
    from scaling.transformer.generate import generate, sample_next
    from scaling.transformer.hf import export_hf, export_peft, import_hf
    from scaling.transformer.inference import TransformerLM, load_model
    from scaling.transformer.jsonl import PromptCompletionDataset
    from scaling.transformer.model import (
        EmbeddingLayer,
        LMHeadLayer,
        TransformerBlock,
        TransformerHeadOutput,
        TransformerLayerIO,
        TransformerLoss,
        layer_specs,
    )

_HOMES = {
    "BlendSourceConfig": "config",
    "FinetuningConfig": "config",
    "TrainingGroupConfig": "config",
    "TransformerArchitectureConfig": "config",
    "TransformerConfig": "config",
    "TransformerBatch": "data",
    "TransformerDataset": "data",
    "build_datasets": "datasets",
    "apply_finetuning": "finetuning",
    "training_groups": "finetuning",
    "generate": "generate",
    "sample_next": "generate",
    "export_hf": "hf",
    "export_peft": "hf",
    "import_hf": "hf",
    "TransformerLM": "inference",
    "load_model": "inference",
    "PromptCompletionDataset": "jsonl",
    "EmbeddingLayer": "model",
    "LMHeadLayer": "model",
    "TransformerBlock": "model",
    "TransformerHeadOutput": "model",
    "TransformerLayerIO": "model",
    "TransformerLoss": "model",
    "layer_specs": "model",
}

__all__ = [
    "BlendSourceConfig",
    "EmbeddingLayer",
    "FinetuningConfig",
    "LMHeadLayer",
    "PromptCompletionDataset",
    "TrainingGroupConfig",
    "TransformerArchitectureConfig",
    "TransformerBatch",
    "TransformerBlock",
    "TransformerConfig",
    "TransformerDataset",
    "TransformerHeadOutput",
    "TransformerLM",
    "TransformerLayerIO",
    "TransformerLoss",
    "apply_finetuning",
    "build_datasets",
    "export_hf",
    "export_peft",
    "generate",
    "import_hf",
    "layer_specs",
    "load_model",
    "sample_next",
    "training_groups",
]


# Any: a module __getattr__ returns whichever name was asked for (mypy types each name from
# its definition; this is only the fallback for imports at run time).
def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'scaling.transformer' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"scaling.transformer.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
