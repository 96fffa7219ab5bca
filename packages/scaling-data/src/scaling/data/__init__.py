"""scaling.data: datasets, a resumable DP-sharded loader, memory-mapped tokens, packing and blending."""

from scaling.data._base import BaseDataset, BaseDatasetBatch, BaseDatasetItem
from scaling.data._blended import BlendedDataset, build_blend_index
from scaling.data._build import load_tokenizer, tokenize_files
from scaling.data._loader import DataLoader
from scaling.data._mmap import MMapTokenBuilder, TokenFileError
from scaling.data._packing import LMPackingBatch, LMPackingDataset, LMPackingItem, segment_positions, stack_windows
from scaling.data._sampler import GlobalBatchSampler, GlobalSampleOrder
from scaling.data._tokens import MMapTokenDataset
from scaling.data._weights import BlendConfig, examples_proportional_weights, explicit_weights, weights_by_size

__all__ = [
    "BaseDataset",
    "BaseDatasetBatch",
    "BaseDatasetItem",
    "BlendConfig",
    "BlendedDataset",
    "DataLoader",
    "GlobalBatchSampler",
    "GlobalSampleOrder",
    "LMPackingBatch",
    "LMPackingDataset",
    "LMPackingItem",
    "MMapTokenBuilder",
    "MMapTokenDataset",
    "TokenFileError",
    "build_blend_index",
    "examples_proportional_weights",
    "explicit_weights",
    "segment_positions",
    "stack_windows",
    "load_tokenizer",
    "tokenize_files",
    "weights_by_size",
]
