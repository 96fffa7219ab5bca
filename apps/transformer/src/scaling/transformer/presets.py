"""Named architectures: the published shapes of the families `import-hf` reads, and small ones
that train on a CPU.

A config starts from one with ``transformer_architecture.preset``; fields set beside it
override it (``transformer_architecture: {preset: qwen3_0.6b, num_layers: 4}``).
``scaling-transformer presets`` lists them with their parameter counts. The counts of the
published shapes equal those of transformers' own models of the exported ``config.json``
(built on the meta device by the tests).
"""

from __future__ import annotations

from scaling.config import JsonDict

_LLAMA3 = {"vocab_size": 128256, "rotary_base": 500000.0, "norm_eps": 1e-5, "tied_embeddings": False}
# Llama 3.1+ stretches the 8k pretraining context 8x (3.2: 32x) with "llama3" RoPE scaling.
_LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}  # fmt: skip
_QWEN3 = {"vocab_size": 151936, "rotary_base": 1000000.0, "norm_eps": 1e-6, "qk_norm": True, "head_dim": 128,
          "max_sequence_length": 40960}  # fmt: skip

PRESETS: dict[str, JsonDict] = {
    "llama3_8b": {**_LLAMA3, "hidden_size": 4096, "num_layers": 32, "num_attention_heads": 32, "num_kv_heads": 8,
                  "intermediate_size": 14336, "max_sequence_length": 8192},
    "llama3.1_8b": {**_LLAMA3, "hidden_size": 4096, "num_layers": 32, "num_attention_heads": 32, "num_kv_heads": 8,
                    "intermediate_size": 14336, "max_sequence_length": 131072, "rope_scaling": _LLAMA31_ROPE},
    "llama3_70b": {**_LLAMA3, "hidden_size": 8192, "num_layers": 80, "num_attention_heads": 64, "num_kv_heads": 8,
                   "intermediate_size": 28672, "max_sequence_length": 8192},
    "llama3.2_1b": {**_LLAMA3, "hidden_size": 2048, "num_layers": 16, "num_attention_heads": 32, "num_kv_heads": 8,
                    "head_dim": 64, "intermediate_size": 8192, "max_sequence_length": 131072,
                    "tied_embeddings": True, "rope_scaling": {**_LLAMA31_ROPE, "factor": 32.0}},
    "qwen3_0.6b": {**_QWEN3, "hidden_size": 1024, "num_layers": 28, "num_attention_heads": 16, "num_kv_heads": 8,
                   "intermediate_size": 3072, "tied_embeddings": True},
    "qwen3_8b": {**_QWEN3, "hidden_size": 4096, "num_layers": 36, "num_attention_heads": 32, "num_kv_heads": 8,
                 "intermediate_size": 12288, "tied_embeddings": False},
    "qwen3_30b_a3b": {**_QWEN3, "hidden_size": 2048, "num_layers": 48, "num_attention_heads": 32, "num_kv_heads": 4,
                      "intermediate_size": 6144, "tied_embeddings": False,
                      "moe": {"num_experts": 128, "top_k": 8, "ffn_size": 768, "normalize_top_k": True,
                              "aux_loss_coefficient": 0.001}},
    # DeepSeek-V3 without its multi-token-prediction layer; YaRN stretches the 4k pretraining context 40x.
    "deepseek_v3_671b": {"vocab_size": 129280, "hidden_size": 7168, "num_layers": 61, "num_attention_heads": 128,
                         "intermediate_size": 18432, "norm_eps": 1e-6, "rotary_base": 10000.0, "rotary_interleaved": True,
                         "max_sequence_length": 163840, "tied_embeddings": False,
                         "rope_scaling": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                                          "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
                         "latent_attention": {"kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
                                              "qk_rope_head_dim": 64, "v_head_dim": 128},
                         "moe": {"num_experts": 256, "top_k": 8, "ffn_size": 2048, "num_shared_experts": 1,
                                 "score_function": "sigmoid", "balancing": "aux_loss_free", "routed_scaling_factor": 2.5,
                                 "num_groups": 8, "top_groups": 4, "first_dense_layers": 3}},
    # Small shapes of the same families: they train on a CPU in seconds (the default corpus's 1024 tokens).
    "tiny_llama3": {**_LLAMA3, "vocab_size": 1024, "hidden_size": 128, "num_layers": 4, "num_attention_heads": 4,
                    "num_kv_heads": 2, "intermediate_size": 384, "max_sequence_length": 2048,
                    "rope_scaling": {**_LLAMA31_ROPE, "original_max_position_embeddings": 256}},
    "tiny_qwen3_moe": {**_QWEN3, "vocab_size": 1024, "hidden_size": 128, "num_layers": 4, "num_attention_heads": 4,
                       "num_kv_heads": 2, "head_dim": 64, "intermediate_size": 384, "max_sequence_length": 2048,
                       "tied_embeddings": False,
                       "moe": {"num_experts": 8, "top_k": 2, "ffn_size": 96, "normalize_top_k": True}},
    "tiny_deepseek_v3": {"vocab_size": 1024, "hidden_size": 128, "num_layers": 4, "num_attention_heads": 4,
                         "intermediate_size": 384, "norm_eps": 1e-6, "rotary_interleaved": True,
                         "max_sequence_length": 2048, "tied_embeddings": False,
                         "latent_attention": {"kv_lora_rank": 32, "q_lora_rank": 64, "qk_nope_head_dim": 32,
                                              "qk_rope_head_dim": 16, "v_head_dim": 32},
                         "moe": {"num_experts": 8, "top_k": 2, "ffn_size": 96, "num_shared_experts": 1,
                                 "score_function": "sigmoid", "balancing": "aux_loss_free", "routed_scaling_factor": 2.5,
                                 "num_groups": 4, "top_groups": 2, "first_dense_layers": 1}},
}  # fmt: skip


def apply_preset(fields: JsonDict) -> JsonDict:
    """``fields`` of a ``transformer_architecture`` section over its ``preset``'s (none: unchanged).

    Raises:
        ValueError: an unknown preset, naming the known ones.
    """
    name = fields.get("preset")
    if name is None:
        return fields
    if name not in PRESETS:
        raise ValueError(
            f"transformer_architecture.preset={name!r} is not a preset; choose one of {sorted(PRESETS)} "
            "(scaling-transformer presets lists them)"
        )
    return {**PRESETS[name], **fields}
