import scaling.nn

EXPECTED = [
    "BaseLayer",
    "BottleneckAdapter",
    "ColumnParallelLinear",
    "CompileConfig",
    "CompileMonitor",
    "Float8Config",
    "KVCache",
    "LayerInputError",
    "LayerNorm",
    "LayerSpec",
    "LoRAConfig",
    "ParallelMLP",
    "ParallelMoE",
    "ParallelSelfAttention",
    "ParallelSwiGLUMLP",
    "ParameterMeta",
    "RMSNorm",
    "RotaryEmbedding",
    "RowParallelLinear",
    "TiedLayerSpec",
    "TokenLayout",
    "VocabParallelEmbedding",
    "all_to_all_attention",
    "apply_bottleneck_adapters",
    "apply_lora",
    "attach_parameter_metas",
    "check_context_parallel",
    "check_float8",
    "check_moe",
    "checkpoint_layer",
    "checkpoint_sequential_layers",
    "compile_layer",
    "compile_layers",
    "enable_float8",
    "export_peft_adapter",
    "float8_linear",
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
    "set_layer_index",
    "tracker_checkpoint_context",
    "unmerge_lora",
    "valid_model_parallel_sizes",
    "vocab_parallel_cross_entropy",
    "vocab_range",
    "write_peft_adapter",
]


def test_all_is_pinned():
    assert scaling.nn.__all__ == EXPECTED


def test_every_name_is_importable():
    for name in EXPECTED:
        assert getattr(scaling.nn, name) is not None, name
