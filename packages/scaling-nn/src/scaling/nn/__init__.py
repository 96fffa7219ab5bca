"""scaling.nn: parallel layers, LayerSpec, ParameterMeta, LoRA and checkpointing."""

from scaling.nn._adapters import BottleneckAdapter, apply_bottleneck_adapters, mark_only_bias_trainable
from scaling.nn._attention import (
    AttentionConfig,
    ParallelSelfAttention,
    check_context_parallel,
    valid_model_parallel_sizes,
)
from scaling.nn._checkpoint import (
    MATMUL_AND_ATTENTION,
    checkpoint_layer,
    checkpoint_sequential_layers,
    tracker_checkpoint_context,
)
from scaling.nn._compile import (
    CompileConfig,
    CompileMonitor,
    check_compile_layout,
    compile_layer,
    compile_layers,
    compile_loss,
)
from scaling.nn._context_parallel import (
    TokenLayout,
    all_to_all_attention,
    ring_attention,
)
from scaling.nn._embedding import (
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
    vocab_parallel_embedding,
    vocab_range,
)
from scaling.nn._float8 import Float8Config, Float8Weight, float8_linear, float8_quantize, float8_supported
from scaling.nn._float8_layers import TensorParallelLinear, check_float8, enable_float8
from scaling.nn._init import LayerInputError
from scaling.nn._layer import (
    BaseLayer,
    LayerSpec,
    TiedLayerSpec,
    attach_parameter_metas,
    named_parameters_with_meta,
    set_layer_index,
)
from scaling.nn._linear import ColumnParallelLinear, RowParallelLinear, column_parallel_linear, row_parallel_linear
from scaling.nn._lora import (
    LoRAConfig,
    apply_lora,
    lora_modules,
    lora_state_dict,
    mark_only_lora_trainable,
    merge_lora,
    unmerge_lora,
)
from scaling.nn._meta import ParameterMeta, get_parameter_meta
from scaling.nn._mla import MLAConfig, MultiHeadLatentAttention
from scaling.nn._mlp import ParallelMLP, ParallelSwiGLUMLP
from scaling.nn._moe import MoEConfig, ParallelMoE, check_moe
from scaling.nn._norm import LayerNorm, RMSNorm, reduce_sequence_parallel_gradients
from scaling.nn._peft import export_peft_adapter, load_peft_adapter, write_peft_adapter
from scaling.nn._rotary import KVCache, RopeScaling, RotaryEmbedding

__all__ = [
    "MATMUL_AND_ATTENTION",
    "AttentionConfig",
    "BaseLayer",
    "BottleneckAdapter",
    "ColumnParallelLinear",
    "CompileConfig",
    "CompileMonitor",
    "Float8Config",
    "Float8Weight",
    "KVCache",
    "LayerInputError",
    "LayerNorm",
    "LayerSpec",
    "LoRAConfig",
    "MLAConfig",
    "MoEConfig",
    "MultiHeadLatentAttention",
    "ParallelMLP",
    "ParallelMoE",
    "ParallelSelfAttention",
    "ParallelSwiGLUMLP",
    "ParameterMeta",
    "RMSNorm",
    "RopeScaling",
    "RotaryEmbedding",
    "RowParallelLinear",
    "TensorParallelLinear",
    "TiedLayerSpec",
    "TokenLayout",
    "VocabParallelEmbedding",
    "all_to_all_attention",
    "apply_bottleneck_adapters",
    "apply_lora",
    "attach_parameter_metas",
    "check_compile_layout",
    "check_context_parallel",
    "check_float8",
    "check_moe",
    "checkpoint_layer",
    "checkpoint_sequential_layers",
    "column_parallel_linear",
    "compile_layer",
    "compile_layers",
    "compile_loss",
    "enable_float8",
    "export_peft_adapter",
    "float8_linear",
    "float8_quantize",
    "float8_supported",
    "get_parameter_meta",
    "load_peft_adapter",
    "lora_modules",
    "lora_state_dict",
    "mark_only_bias_trainable",
    "mark_only_lora_trainable",
    "merge_lora",
    "named_parameters_with_meta",
    "reduce_sequence_parallel_gradients",
    "ring_attention",
    "row_parallel_linear",
    "set_layer_index",
    "tracker_checkpoint_context",
    "unmerge_lora",
    "valid_model_parallel_sizes",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_embedding",
    "vocab_range",
    "write_peft_adapter",
]
