"""scaling.transformer: GPT/Llama-style LLM trainer, generation and Hugging Face interop."""

from scaling.transformer.config import TransformerArchitectureConfig, TransformerConfig
from scaling.transformer.data import TransformerBatch, TransformerDataset
from scaling.transformer.generate import generate, sample_next
from scaling.transformer.hf import export_hf, import_hf
from scaling.transformer.inference import TransformerLM, load_model
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
    "EmbeddingLayer",
    "LMHeadLayer",
    "TransformerArchitectureConfig",
    "TransformerBatch",
    "TransformerBlock",
    "TransformerConfig",
    "TransformerDataset",
    "TransformerHeadOutput",
    "TransformerLM",
    "TransformerLayerIO",
    "TransformerLoss",
    "export_hf",
    "generate",
    "import_hf",
    "layer_specs",
    "load_model",
    "sample_next",
]
