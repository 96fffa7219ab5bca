"""scaling.transformer: GPT/Llama-style LLM trainer, generation and Hugging Face interop."""

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
