"""Hugging Face interop: Llama 2/3.x, Qwen2/2.5, Qwen3, Qwen3-MoE, DeepSeek-V3 and Mixtral
checkpoints (config.json + safetensors) in and out.

Name map (ours <- HF), ``N`` blocks, block ``i`` is our layer ``i + 1``:

- ``layers.0.embedding.weight`` <- ``model.embed_tokens.weight``
- ``layers.{i+1}.input_norm.weight`` <- ``model.layers.{i}.input_layernorm.weight``
- ``layers.{i+1}.attention.qkv.{weight,bias}`` <- ``q_proj``, ``k_proj``, ``v_proj`` regrouped per kv
  head (the query heads of group ``g``, key ``g``, value ``g``: scaling.nn's fused layout)
- ``layers.{i+1}.attention.{q,k}_norm`` <- ``self_attn.{q,k}_norm.weight`` (Qwen3's QK-norm)
- ``layers.{i+1}.attention.dense.weight`` <- ``self_attn.o_proj.weight``
- ``layers.{i+1}.mlp_norm.weight`` <- ``post_attention_layernorm.weight``
- ``layers.{i+1}.mlp.{gate,up,down}_proj.weight`` <- ``mlp.{gate,up,down}_proj.weight``
- ``layers.{N+1}.norm.weight`` <- ``model.norm.weight``;
  ``layers.{N+1}.embedding.weight`` <- ``lm_head.weight`` (absent when tied)

Mixture-of-experts blocks, instead of the MLP (softmax router, top-k, renormalised as
``moe.normalize_top_k`` says):

- ``layers.{i+1}.mlp.router`` <- Mixtral ``block_sparse_moe.gate.weight``, Qwen3-MoE ``mlp.gate.weight``
- ``layers.{i+1}.mlp.experts.{e}.{gate,up,down}`` <- Mixtral ``block_sparse_moe.experts.{e}.{w1,w3,w2}.weight``,
  Qwen3-MoE and DeepSeek-V3 ``mlp.experts.{e}.{gate,up,down}_proj.weight`` (the checkpoint layouts
  every transformers version reads and writes; transformers 5 fuses the experts in memory only)
- DeepSeek-V3 also: ``layers.{i+1}.mlp.expert_bias`` <- ``mlp.gate.e_score_correction_bias`` (the
  aux-loss-free bias), ``layers.{i+1}.mlp.shared.{gate,up,down}_proj.weight`` <-
  ``mlp.shared_experts.{gate,up,down}_proj.weight``

DeepSeek-V3's latent attention, instead of the fused QKV: ``attention.{q_a, q_a_norm.weight,
q_b.weight}`` (or ``attention.q.weight`` without a query latent), ``attention.{kv_a,
kv_a_norm.weight, kv_b.weight}`` <- ``self_attn.{q_a_proj, q_a_layernorm, q_b_proj (q_proj),
kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj}.weight``.

Which family an export writes follows from the architecture: latent attention is DeepSeek-V3;
mixture of experts with QK-norm is Qwen3-MoE, without it Mixtral; dense with QK-norm is Qwen3,
with biases on the QKV projection only Qwen2, otherwise Llama.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from scaling.config import JsonDict
from scaling.data import load_tokenizer
from scaling.nn import named_parameters_with_meta, write_peft_adapter
from scaling.trainer import checkpoint
from scaling.transformer.config import (
    LatentAttentionConfig,
    MoEConfig,
    RopeScalingConfig,
    TransformerArchitectureConfig,
    TransformerConfig,
)
from scaling.transformer.corpus import EOD_TOKEN, default_paths
from scaling.transformer.inference import TransformerLM, latest_config, load_model

CHECKPOINT_SUBDIR = "checkpoint"


@dataclass(frozen=True)
class _Family:
    """What one HF model type fixes of the architecture, and where its MoE weights live."""

    architecture: str
    qk_norm: bool = False
    qkv_bias_only: bool = False  # Qwen2: biases on q/k/v, none on o_proj or the MLP
    moe_module: str | None = None  # the block's MoE submodule (a mixture-of-experts family)
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # our gate, up, down


FAMILIES = {
    "llama": _Family("LlamaForCausalLM"),
    "qwen2": _Family("Qwen2ForCausalLM", qkv_bias_only=True),
    "qwen3": _Family("Qwen3ForCausalLM", qk_norm=True),
    "mixtral": _Family("MixtralForCausalLM", moe_module="block_sparse_moe", expert_names=("w1", "w3", "w2")),
    "qwen3_moe": _Family("Qwen3MoeForCausalLM", qk_norm=True, moe_module="mlp"),
    "deepseek_v3": _Family("DeepseekV3ForCausalLM", moe_module="mlp"),
}
# Latent attention (ours <- DeepSeek-V3's ``self_attn.*``): q_a / q directly, norms, kv_a, kv_b.
_LATENT_NAMES = {
    "q_a": "q_a_proj.weight",
    "q_a_norm.weight": "q_a_layernorm.weight",
    "q_b.weight": "q_b_proj.weight",
    "q.weight": "q_proj.weight",
    "kv_a": "kv_a_proj_with_mqa.weight",
    "kv_a_norm.weight": "kv_a_layernorm.weight",
    "kv_b.weight": "kv_b_proj.weight",
}
_NAMES = ", ".join(f"{kind!r} / {f.architecture}" for kind, f in FAMILIES.items())


def family_of(arch: TransformerArchitectureConfig) -> str:
    """The HF model type an export of ``arch`` writes (see the module docstring)."""
    if arch.latent_attention is not None:
        return "deepseek_v3"
    if arch.moe is not None:
        return "qwen3_moe" if arch.qk_norm else "mixtral"
    if arch.qk_norm:
        return "qwen3"
    return "qwen2" if arch.qkv_bias and not arch.bias else "llama"


def _moe_from_hf(hf: JsonDict, kind: str, source: Path) -> MoEConfig:
    if kind == "deepseek_v3":  # sigmoid scores with the correction bias, groups, dense first blocks
        return MoEConfig(
            num_experts=hf.get("n_routed_experts") or hf["num_local_experts"],
            top_k=hf["num_experts_per_tok"],
            ffn_size=hf["moe_intermediate_size"],
            score_function="sigmoid",
            balancing="aux_loss_free",
            normalize_top_k=bool(hf.get("norm_topk_prob", True)),
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            num_groups=hf.get("n_group") or 1,
            top_groups=hf.get("topk_group") or 1,
            num_shared_experts=hf.get("n_shared_experts") or 0,
            first_dense_layers=hf.get("first_k_dense_replace", 0),
        )
    if kind == "mixtral":
        if hf.get("sliding_window") is not None or float(hf.get("router_jitter_noise") or 0.0) != 0.0:
            raise ValueError(
                f"{source}: sliding_window={hf.get('sliding_window')}, router_jitter_noise="
                f"{hf.get('router_jitter_noise')} are not supported; only full attention and a noise-free router"
            )
        return MoEConfig(
            every=1,
            num_experts=hf.get("num_local_experts") or hf["num_experts"],
            top_k=hf["num_experts_per_tok"],
            ffn_size=hf["intermediate_size"],
            aux_loss_coefficient=float(hf.get("router_aux_loss_coef", 0.001)),
        )
    if hf.get("mlp_only_layers"):
        raise ValueError(
            f"{source}: mlp_only_layers={hf['mlp_only_layers']} is not supported; the app places dense blocks by "
            "decoder_sparse_step (moe.every) only"
        )
    return MoEConfig(
        every=hf.get("decoder_sparse_step", 1),
        num_experts=hf.get("num_experts") or hf["num_local_experts"],
        top_k=hf["num_experts_per_tok"],
        ffn_size=hf["moe_intermediate_size"],
        normalize_top_k=bool(hf.get("norm_topk_prob", False)),
        aux_loss_coefficient=float(hf.get("router_aux_loss_coef", 0.001)),
    )


def _rope_from_hf(hf: JsonDict, source: Path) -> tuple[float, RopeScalingConfig | None]:
    """RoPE base and scaling from ``rope_parameters`` (transformers >= 5) or ``rope_theta``/``rope_scaling``."""
    rope: JsonDict = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    theta = float(rope.get("rope_theta") or hf.get("rope_theta") or 10000.0)
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"{source}: partial_rotary_factor={partial} is not supported; only whole heads rotated")
    if rope_type == "default":
        return theta, None
    if rope_type not in ("linear", "llama3", "yarn"):
        raise ValueError(
            f"{source}: rope_type={rope_type!r} is not supported; import-hf reads 'default', 'linear', 'llama3' "
            "and 'yarn'"
        )
    fields = RopeScalingConfig.model_fields.keys() - {"rope_type"}
    scaling = {k: rope[k] for k in fields if rope.get(k) is not None}
    if rope_type == "yarn" and "factor" not in scaling:  # transformers' rule: the context ratio
        scaling["factor"] = hf["max_position_embeddings"] / rope["original_max_position_embeddings"]
    return theta, RopeScalingConfig(rope_type=rope_type, **scaling)


def _arch_from_hf(hf: JsonDict, source: Path) -> TransformerArchitectureConfig:
    kind = hf.get("model_type")
    archs = hf.get("architectures") or []
    family = FAMILIES.get(str(kind))
    if family is None or any(a != family.architecture for a in archs):
        raise ValueError(
            f"{source}: model_type={kind!r}, architectures={archs} is not a checkpoint import-hf reads; "
            f"it reads {_NAMES}"
        )
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{source}: hidden_act={hf['hidden_act']!r}; only 'silu' (SwiGLU) is supported")
    windows = [t for t in hf.get("layer_types") or [] if t != "full_attention"]
    if hf.get("use_sliding_window") or windows:
        raise ValueError(
            f"{source}: use_sliding_window={hf.get('use_sliding_window')}, layer_types with {windows[:1]} is not "
            "supported; only full attention"
        )
    bias = bool(hf.get("attention_bias", False))
    if kind == "llama" and bias != bool(hf.get("mlp_bias", False)):
        raise ValueError(
            f"{source}: attention_bias={hf.get('attention_bias')} with mlp_bias={hf.get('mlp_bias')}; our "
            "transformer_architecture.bias switches both together"
        )
    if kind != "llama" and bias:
        raise ValueError(f"{source}: attention_bias=True is not supported for model_type={kind!r}")
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    rotary_base, rope_scaling = _rope_from_hf(hf, source)
    latent = None
    if kind == "deepseek_v3":
        fields = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        latent = LatentAttentionConfig(**{k: hf[k] for k in fields})
        head_dim = hf["hidden_size"] // heads  # its head_dim is the RoPE channels'
    return TransformerArchitectureConfig(
        latent_attention=latent,
        rotary_interleaved=bool(hf.get("rope_interleave", True)) if latent is not None else False,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_attention_heads=heads,
        num_kv_heads=None if latent is not None else hf.get("num_key_value_heads") or heads,
        head_dim=None if head_dim * heads == hf["hidden_size"] else head_dim,
        mlp_type="swiglu",
        intermediate_size=hf["intermediate_size"],
        norm="rmsnorm",
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        rotary_base=rotary_base,
        rope_scaling=rope_scaling,
        max_sequence_length=hf.get("max_position_embeddings", 2048),
        bias=bias,
        qkv_bias=family.qkv_bias_only,
        qk_norm=family.qk_norm,
        tied_embeddings=bool(hf.get("tie_word_embeddings", False)),
        moe=_moe_from_hf(hf, str(kind), source) if family.moe_module else None,
    )


def _check_exportable(arch: TransformerArchitectureConfig) -> str:
    """The family ``arch`` exports as; raises ValueError naming the fields no family has."""
    kind = family_of(arch)
    wrong: dict[str, tuple[object, object]] = {
        "mlp_type": (arch.mlp_type, "swiglu"),
        "norm": (arch.norm, "rmsnorm"),
        "rotary_percentage": (arch.rotary_percentage, 1.0),
        "causal": (arch.causal, True),
    }
    if kind != "deepseek_v3":  # transformers' other families rotate half-split pairs only
        wrong["rotary_interleaved"] = (arch.rotary_interleaved, False)
    if kind != "llama":
        wrong["bias"] = (arch.bias, False)
    if kind in ("qwen3", "qwen3_moe", "mixtral", "deepseek_v3"):
        wrong["qkv_bias"] = (arch.qkv_bias, False)
    moe = arch.moe
    if kind == "deepseek_v3":
        wrong["moe"] = ("null" if moe is None else "set", "set")
    if moe is not None and kind == "deepseek_v3":
        wrong.update(
            {
                "moe.every": (moe.every, 1),
                "moe.score_function": (moe.score_function, "sigmoid"),
                # Its router's correction bias is the aux-loss-free bias.
                "moe.balancing": (moe.balancing, "aux_loss_free"),
            }
        )
    elif moe is not None:
        wrong.update(
            {
                "moe.num_shared_experts": (moe.num_shared_experts, 0),
                "moe.score_function": (moe.score_function, "softmax"),
                "moe.first_dense_layers": (moe.first_dense_layers, 0),
                "moe.num_groups": (moe.num_groups, 1),
                "moe.routed_scaling_factor": (moe.routed_scaling_factor, 1.0),
                # Their routers have no bias: an aux-loss-free model would route differently.
                "moe.balancing": ("aux_loss_free" if moe.balancing == "aux_loss_free" else "aux_loss", "aux_loss"),
            }
        )
        if kind == "mixtral":
            wrong.update({"moe.every": (moe.every, 1), "moe.normalize_top_k": (moe.normalize_top_k, True)})
    bad = {k: v for k, (v, want) in wrong.items() if v != want}
    if bad:
        raise ValueError(
            f"export-hf writes this model as {FAMILIES[kind].architecture}, which needs "
            f"{', '.join(f'{k}={wrong[k][1]!r}' for k in bad)}; this model has {bad}"
        )
    return kind


def _mapping(arch: TransformerArchitectureConfig) -> dict[str, str]:
    """Our parameter name -> HF name (the fused qkv excluded)."""
    family = FAMILIES[family_of(arch)]
    n = arch.num_layers
    names = {
        "layers.0.embedding.weight": "model.embed_tokens.weight",
        f"layers.{n + 1}.norm.weight": "model.norm.weight",
    }
    if not arch.tied_embeddings:
        names[f"layers.{n + 1}.embedding.weight"] = "lm_head.weight"
    for i in range(n):
        ours, hf = f"layers.{i + 1}", f"model.layers.{i}"
        names[f"{ours}.input_norm.weight"] = f"{hf}.input_layernorm.weight"
        names[f"{ours}.attention.dense.weight"] = f"{hf}.self_attn.o_proj.weight"
        names[f"{ours}.mlp_norm.weight"] = f"{hf}.post_attention_layernorm.weight"
        if arch.qk_norm:
            names[f"{ours}.attention.q_norm"] = f"{hf}.self_attn.q_norm.weight"
            names[f"{ours}.attention.k_norm"] = f"{hf}.self_attn.k_norm.weight"
        latent = arch.latent_attention
        if latent is not None:
            skip = ("q_a", "q_a_norm.weight", "q_b.weight") if latent.q_lora_rank is None else ("q.weight",)
            for mine, theirs in _LATENT_NAMES.items():
                if mine not in skip:
                    names[f"{ours}.attention.{mine}"] = f"{hf}.self_attn.{theirs}"
        moe_config = arch.moe
        if moe_config is not None and arch.is_moe_block(i):
            moe = f"{hf}.{family.moe_module}"
            names[f"{ours}.mlp.router"] = f"{moe}.gate.weight"
            if family_of(arch) == "deepseek_v3":
                names[f"{ours}.mlp.expert_bias"] = f"{moe}.gate.e_score_correction_bias"
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    names[f"{ours}.mlp.shared.{proj}.weight"] = f"{moe}.shared_experts.{proj}.weight"
            for e in range(moe_config.num_experts):
                for proj, theirs in zip(("gate", "up", "down"), family.expert_names):
                    names[f"{ours}.mlp.experts.{e}.{proj}"] = f"{moe}.experts.{e}.{theirs}.weight"
            continue
        for proj in ("gate_proj", "up_proj", "down_proj"):
            names[f"{ours}.mlp.{proj}.weight"] = f"{hf}.mlp.{proj}.weight"
        if arch.bias:
            names[f"{ours}.attention.dense.bias"] = f"{hf}.self_attn.o_proj.bias"
            for proj in ("gate_proj", "up_proj", "down_proj"):
                names[f"{ours}.mlp.{proj}.bias"] = f"{hf}.mlp.{proj}.bias"
    return names


def _qkv_suffixes(arch: TransformerArchitectureConfig) -> tuple[str, ...]:
    """The fused QKV projection's parameters (none with latent attention)."""
    if arch.latent_attention is not None:
        return ()
    return ("weight", "bias") if arch.bias or arch.qkv_bias else ("weight",)


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, nkv: int) -> torch.Tensor:
    rest = q.shape[1:]
    return torch.cat([q.reshape(nkv, -1, *rest), k.reshape(nkv, -1, *rest), v.reshape(nkv, -1, *rest)], 1).reshape(
        -1, *rest
    )


def _split_qkv(qkv: torch.Tensor, arch: TransformerArchitectureConfig) -> tuple[torch.Tensor, ...]:
    nkv, d = arch.kv_heads, arch.head_size
    r = arch.num_attention_heads // nkv
    groups = qkv.reshape(nkv, (r + 2) * d, *qkv.shape[1:])
    q, k, v = groups.split([r * d, d, d], dim=1)
    return tuple(t.reshape(-1, *qkv.shape[1:]).contiguous() for t in (q, k, v))


def save_model(model: TransformerLM, config: TransformerConfig, checkpoint_dir: str | Path) -> Path:
    """Write the one-process model as a step-0 checkpoint (loadable by train's load_dir and generate)."""
    params = list(named_parameters_with_meta(model))
    checkpoint.save_checkpoint(
        checkpoint_dir,
        0,
        {"model": checkpoint.model_state_dict(params, None)},
        None,
        extra={"config": config.as_dict()},
    ).wait()
    return Path(checkpoint_dir)


def _output_folder(path: str | Path) -> Path:
    """``path`` as an output folder: refused when it exists and is not a folder (before any work)."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ValueError(f"output {str(out)!r} exists and is not a folder; give a folder to write into")
    return out


def import_hf(hf_dir: str | Path, output_dir: str | Path) -> Path:
    """Convert an HF folder of a family in :data:`FAMILIES` into ``output_dir/config.yml`` and
    ``output_dir/checkpoint``.

    Raises:
        ValueError: for another architecture, unsupported settings, or a tensor the folder lacks (named).
        FileNotFoundError: when ``config.json`` or the safetensors files are missing.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    hf_dir, out = Path(hf_dir), _output_folder(output_dir)
    if not (hf_dir / "config.json").is_file():
        raise FileNotFoundError(f"{hf_dir}: no config.json; import-hf needs a save_pretrained folder")
    try:
        hf_config = json.loads((hf_dir / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{hf_dir / 'config.json'} is not valid JSON ({exc}); give a save_pretrained folder") from None
    arch = _arch_from_hf(hf_config, hf_dir)
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{hf_dir}: no *.safetensors files (save with safe_serialization=True)")
    hf_state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            hf_state.update(load_file(str(f)))
        except SafetensorError as exc:
            raise ValueError(f"{f} is not a readable safetensors file ({exc}); is it truncated?") from None
    config = TransformerConfig.from_dict(
        {
            "runner": {"runner_type": "local", "nproc_per_node": 1},
            "topology": {"world_size": 1, "global_batch_size": 1, "micro_batch_size": 1, "device": "cpu"},
            "transformer_architecture": arch.as_dict(),
            "data": {"sequence_length": min(128, arch.max_sequence_length)},
        }
    )
    model = TransformerLM(arch)
    params = dict(model.named_parameters())
    mapping = _mapping(arch)
    qkv = [f"model.layers.{i}.self_attn.{x}_proj.{suffix}" for i in range(arch.num_layers) for x in "qkv"
           for suffix in _qkv_suffixes(arch)]  # fmt: skip
    missing = [name for name in [*mapping.values(), *qkv] if name not in hf_state]
    if missing:
        raise ValueError(
            f"{hf_dir}: the safetensors files lack {len(missing)} tensor(s) a {hf_config.get('model_type')} model of "
            f"this config.json has, e.g. {missing[:3]}; is the folder complete?"
        )
    with torch.no_grad():
        for ours, theirs in mapping.items():
            params[ours].copy_(hf_state[theirs])
        for i in range(arch.num_layers):
            p = f"model.layers.{i}.self_attn"
            for suffix in _qkv_suffixes(arch):
                q, k, v = (hf_state[f"{p}.{x}_proj.{suffix}"] for x in "qkv")
                fused = _fuse_qkv(q, k, v, arch.kv_heads)
                params[f"layers.{i + 1}.attention.qkv.{suffix}"].copy_(fused)
    out.mkdir(parents=True, exist_ok=True)
    config.save(out / "config.yml")
    save_model(model, config, out / CHECKPOINT_SUBDIR)
    return out


def _hf_config(arch: TransformerArchitectureConfig, kind: str) -> JsonDict:
    """The ``config.json`` of ``arch`` as HF model type ``kind`` (read by transformers 4 and 5)."""
    rope: JsonDict = {"rope_theta": arch.rotary_base, "rope_type": "default"}
    if arch.rope_scaling is not None:
        rope = {"rope_theta": arch.rotary_base, **arch.rope_scaling.hf_fields()}
    hf: JsonDict = {
        "architectures": [FAMILIES[kind].architecture],
        "model_type": kind,
        "vocab_size": arch.vocab_size,
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.ffn_size,
        "num_hidden_layers": arch.num_layers,
        "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": arch.kv_heads,
        "head_dim": arch.head_size,
        "hidden_act": "silu",
        "max_position_embeddings": arch.max_sequence_length,
        "rms_norm_eps": arch.norm_eps,
        "rope_theta": arch.rotary_base,
        "rope_parameters": rope,
        "tie_word_embeddings": arch.tied_embeddings,
        "torch_dtype": {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[arch.precision],
    }
    if arch.rope_scaling is not None:  # transformers 4 reads the scaling from here
        hf["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    if kind == "llama":
        hf.update(attention_bias=arch.bias, mlp_bias=arch.bias)
    if kind in ("qwen2", "qwen3", "qwen3_moe"):
        hf.update(use_sliding_window=False, sliding_window=None)
    if kind in ("qwen3", "qwen3_moe"):
        hf.update(attention_bias=False)
    moe = arch.moe
    if moe is not None:
        hf.update(
            num_experts_per_tok=moe.top_k,
            router_aux_loss_coef=moe.aux_loss_coefficient,
            output_router_logits=False,
        )
    if moe is not None and kind == "mixtral":
        hf.update(
            intermediate_size=moe.ffn_size or arch.ffn_size, num_local_experts=moe.num_experts, sliding_window=None
        )
    latent = arch.latent_attention
    if moe is not None and latent is not None:  # deepseek_v3
        hf.update(
            latent.as_dict(),
            head_dim=latent.qk_rope_head_dim,  # transformers' RoPE reads its size here
            num_key_value_heads=arch.num_attention_heads,
            rope_interleave=arch.rotary_interleaved,
            attention_bias=False,
            n_routed_experts=moe.num_experts,
            moe_intermediate_size=moe.ffn_size or arch.ffn_size,
            n_shared_experts=moe.num_shared_experts,
            routed_scaling_factor=moe.routed_scaling_factor,
            n_group=moe.num_groups,
            topk_group=moe.top_groups,
            first_k_dense_replace=moe.first_dense_layers,
            norm_topk_prob=moe.normalize_top_k,
            num_nextn_predict_layers=0,  # no multi-token prediction layers
        )
    if moe is not None and kind == "qwen3_moe":
        hf.update(
            moe_intermediate_size=moe.ffn_size or arch.ffn_size,
            num_experts=moe.num_experts,
            norm_topk_prob=moe.normalize_top_k,
            decoder_sparse_step=moe.every,
            mlp_only_layers=[],
        )
    return hf


def export_hf(
    checkpoint: str | Path,
    output_dir: str | Path,
    config_path: str | Path | None = None,
    tokenizer: str | Path | None = None,
) -> Path:
    """Write a checkpoint of any layout as an HF folder of its family (Llama, Qwen2, Qwen3, Mixtral or
    Qwen3-MoE: :func:`family_of`; ``config.json``, ``model.safetensors``) with its tokenizer (``tokenizer.json``, ``tokenizer_config.json``,
    ``generation_config.json``), so ``AutoTokenizer``, ``AutoModelForCausalLM`` and
    ``pipeline("text-generation")`` load the folder as it is.

    Args:
        tokenizer: the ``tokenizer.json`` to ship; None: ``data.tokenizer_path`` of the checkpoint's
            config, else the default corpus's (as ``generate`` picks it), left out when neither exists
            or when the default corpus's has more tokens than the model (it is another model's).

    Returns:
        The folder (``tokenizer.json`` is in it when a tokenizer was found).

    Raises:
        ValueError: when the architecture fits no family (the fields are named),
            or the tokenizer has more tokens than the model's vocabulary.
        FileNotFoundError: ``tokenizer`` was given and does not exist.
    """
    from safetensors.torch import save_file

    out = _output_folder(output_dir)
    config = TransformerConfig.from_yaml(config_path) if config_path is not None else None
    model, config = load_model(checkpoint, config)
    arch = config.transformer_architecture
    kind = _check_exportable(arch)
    if tokenizer is not None and not Path(tokenizer).is_file():
        raise FileNotFoundError(f"--tokenizer {str(tokenizer)!r} does not exist; give the path of a tokenizer.json")
    chosen = tokenizer or config.data.tokenizer_path
    found = Path(chosen or default_paths(config.data.default_corpus_dir)["tokenizer"])
    shipped = found if found.is_file() else None
    if shipped is not None and chosen is None and load_tokenizer(shipped).get_vocab_size() > arch.vocab_size:
        # The default corpus's tokenizer (a `preprocess` in this folder) belongs to another model, an
        # imported one say: it is left out, as when there is none, rather than failing the export.
        shipped = None
    params = dict(model.named_parameters())
    state = {theirs: params[ours].detach().contiguous() for ours, theirs in _mapping(arch).items()}
    for i in range(arch.num_layers):
        p = f"model.layers.{i}.self_attn"
        for suffix in _qkv_suffixes(arch):
            q, k, v = _split_qkv(params[f"layers.{i + 1}.attention.qkv.{suffix}"].detach(), arch)
            state.update({f"{p}.q_proj.{suffix}": q, f"{p}.k_proj.{suffix}": k, f"{p}.v_proj.{suffix}": v})
    hf_config = _hf_config(arch, kind)
    out.mkdir(parents=True, exist_ok=True)
    if shipped is not None:
        hf_config.update(_write_tokenizer(shipped, out, arch))
    (out / "config.json").write_text(json.dumps(hf_config, indent=2))
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _write_tokenizer(path: Path, out: Path, arch: TransformerArchitectureConfig) -> JsonDict:
    """Ship ``path`` as a fast tokenizer folder; returns the special token ids for ``config.json``."""
    tokenizer = load_tokenizer(path)
    if tokenizer.get_vocab_size() > arch.vocab_size:
        raise ValueError(
            f"tokenizer {path} has {tokenizer.get_vocab_size()} tokens, more than transformer_architecture."
            f"vocab_size={arch.vocab_size}; give the tokenizer the model was trained with (--tokenizer)"
        )
    out.joinpath("tokenizer.json").write_bytes(path.read_bytes())
    eod = tokenizer.token_to_id(EOD_TOKEN)
    settings: JsonDict = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": arch.max_sequence_length,
        "clean_up_tokenization_spaces": False,
    }
    ids: JsonDict = {}
    if eod is not None:  # GPT-2's convention: the document separator ends a generation and pads
        settings.update(eos_token=EOD_TOKEN, pad_token=EOD_TOKEN)
        ids = {"eos_token_id": eod, "pad_token_id": eod}
    (out / "tokenizer_config.json").write_text(json.dumps(settings, indent=2))
    (out / "generation_config.json").write_text(json.dumps(ids, indent=2))
    return ids


# Our block-relative LoRA module -> the Llama modules (qkv is one fused module here, three in HF).
_PEFT_NAMES = {
    "attention.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "attention.dense": ("self_attn.o_proj",),
    "mlp.gate_proj": ("mlp.gate_proj",),
    "mlp.up_proj": ("mlp.up_proj",),
    "mlp.down_proj": ("mlp.down_proj",),
}


def check_peft_exportable(checkpoint: str | Path, config_path: str | Path | None = None) -> TransformerConfig:
    """The run's config (``config_path``, else the one saved with ``checkpoint``) when its model
    can be exported as a PEFT adapter (:func:`export_peft`); reads no weights.

    Raises:
        ValueError: when the config's ``finetuning.method`` is not LoRA or the model is not Llama-compatible.
    """
    if config_path is not None:
        config = TransformerConfig.from_yaml(config_path)
    else:
        config = TransformerConfig.from_dict(latest_config(checkpoint))
    _check_exportable(config.transformer_architecture)
    if config.transformer_architecture.latent_attention is not None:
        raise ValueError(
            "PEFT adapters of a model with latent attention (DeepSeek-V3) are not written yet; export-hf without "
            "--peft-dir writes the base model"
        )
    if config.finetuning.method != "lora":
        raise ValueError(
            f"finetuning.method={config.finetuning.method!r} in the checkpoint's config; a PEFT adapter needs a "
            "model trained with finetuning.method='lora'"
        )
    return config


def export_peft(checkpoint: str | Path, output_dir: str | Path, config_path: str | Path | None = None) -> Path:
    """Write the LoRA adapters of a ``finetuning.method='lora'`` checkpoint as a PEFT adapter folder.

    The folder (``adapter_config.json``, ``adapter_model.safetensors``) loads with
    ``peft.PeftModel.from_pretrained`` on the :func:`export_hf` model. The fused QKV adapter
    becomes three: ``A`` shared, ``B`` split by rows like the fused weight, which is exact.

    Raises:
        ValueError: when the checkpoint was not trained with LoRA or the model is not Llama-compatible.
    """

    config = check_peft_exportable(checkpoint, config_path)
    model, config = load_model(checkpoint, config)
    arch, ft = config.transformer_architecture, config.finetuning
    tensors: dict[str, torch.Tensor] = {}
    targets: set[str] = set()
    for i, block in enumerate(model.blocks):
        for name, module in block.named_modules():
            if not hasattr(module, "lora_A"):
                continue
            a, b = module.lora_A.weight.detach(), module.lora_B.weight.detach()
            hf_names = _PEFT_NAMES[name]
            b_parts = _split_qkv(b, arch) if name == "attention.qkv" else (b,)
            for hf_name, b_part in zip(hf_names, b_parts):
                key = f"base_model.model.model.layers.{i}.{hf_name}"
                tensors[f"{key}.lora_A.weight"] = a.contiguous().clone()
                tensors[f"{key}.lora_B.weight"] = b_part.contiguous().clone()
                targets.add(hf_name.rsplit(".", 1)[1])
    out = Path(output_dir)
    write_peft_adapter(
        out, tensors, rank=ft.rank, alpha=ft.alpha, dropout=ft.dropout, target_modules=targets, task_type="CAUSAL_LM"
    )
    return out
