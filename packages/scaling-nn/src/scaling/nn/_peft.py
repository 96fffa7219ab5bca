"""LoRA adapters to and from the PEFT on-disk format (``adapter_config.json`` +
``adapter_model.safetensors``, keys ``base_model.model.<module>.lora_{A,B}.weight``).

Tensor-parallel shards are gathered into full tensors for export and sliced on import,
following each parameter's meta, so an adapter trained at any TP size loads with
``peft.PeftModel.from_pretrained`` and back into any TP size.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from scaling.collectives import all_gather
from scaling.nn._lora import LoRAConfig, _tp_of, apply_lora, lora_modules
from scaling.nn._meta import get_parameter_meta

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from scaling.topology import RNGTracker

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
_PREFIX = "base_model.model."


# Any: safetensors.torch, an optional module (the [peft] extra).
def _safetensors() -> Any:
    try:
        import safetensors.torch
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            "PEFT adapter files need the safetensors package, scaling-nn's [peft] extra: "
            "pip install './packages/scaling-nn[peft]' from a checkout (or pip install safetensors)"
        ) from None
    return safetensors.torch


def _full(param: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    meta = get_parameter_meta(param)
    t = param.detach()
    if meta.parallel_dim is None or group is None or dist.get_world_size(group) == 1:
        return t.clone()
    return all_gather(t.contiguous(), group, dim=meta.parallel_dim).narrow(
        meta.parallel_dim, 0, meta.logical_shape[meta.parallel_dim]
    )


def write_peft_adapter(
    path: str | os.PathLike[str],
    tensors: dict[str, torch.Tensor],
    *,
    rank: int,
    alpha: float,
    dropout: float,
    target_modules: set[str] | list[str],
    task_type: str | None = None,
    base_model_name_or_path: str | None = None,
) -> None:
    """Write full LoRA ``tensors`` (PEFT keys) and their ``adapter_config.json`` into ``path``.

    The on-disk half of :func:`export_peft_adapter`, for callers that build the PEFT keys
    themselves (e.g. splitting a fused QKV adapter into ``q_proj``/``k_proj``/``v_proj``).
    """
    save_file = _safetensors().save_file
    os.makedirs(path, exist_ok=True)
    adapter_config = {
        "peft_type": "LORA",
        "task_type": task_type,
        "base_model_name_or_path": base_model_name_or_path,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": sorted(target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }
    with open(os.path.join(path, CONFIG_NAME), "w") as f:
        json.dump(adapter_config, f, indent=2)
    save_file(
        {k: t.contiguous() for k, t in tensors.items()}, os.path.join(path, WEIGHTS_NAME), metadata={"format": "pt"}
    )


def export_peft_adapter(
    model: torch.nn.Module,
    config: LoRAConfig,
    path: str,
    name_map: dict[str, str] | None = None,
    base_model_name_or_path: str | None = None,
) -> dict[str, torch.Tensor]:
    """Write the LoRA adapters of ``model`` as a PEFT adapter folder.

    Call on every rank of the TP group (the shards are all-gathered); the process with
    global rank 0 (or the only process) writes. ``name_map`` renames modules (ours ->
    the PEFT base model's). Returns the full tensors by PEFT key.
    """
    name_map = name_map or {}
    tensors: dict[str, torch.Tensor] = {}
    for name, module in lora_modules(model):
        group = _tp_of(module).group
        target = name_map.get(name, name)
        for factor in ("lora_A", "lora_B"):
            full = _full(getattr(module, factor).weight, group)
            tensors[f"{_PREFIX}{target}.{factor}.weight"] = full.to("cpu").contiguous()
    if not dist.is_initialized() or dist.get_rank() == 0:
        write_peft_adapter(
            path,
            tensors,
            rank=config.rank,
            alpha=config.alpha,
            dropout=config.dropout,
            target_modules={name_map.get(n, n) for n, _ in lora_modules(model)},
            base_model_name_or_path=base_model_name_or_path,
        )
    return tensors


def load_peft_adapter(
    model: torch.nn.Module, path: str, name_map: dict[str, str] | None = None, rng_tracker: RNGTracker | None = None
) -> LoRAConfig:
    """Add (if missing) and load the LoRA adapters of a PEFT adapter folder into ``model``.

    Every rank reads the file and keeps its shards. ``name_map`` maps our module names to
    the PEFT names, as for :func:`export_peft_adapter`.

    Raises:
        ValueError: for a non-LoRA adapter, rsLoRA/DoRA, or missing / mis-shaped tensors.
    """
    load_file = _safetensors().load_file
    with open(os.path.join(path, CONFIG_NAME)) as f:
        raw = json.load(f)
    if raw.get("peft_type") != "LORA" or raw.get("use_rslora") or raw.get("use_dora"):
        raise ValueError(
            f"{path}: peft_type={raw.get('peft_type')!r}, use_rslora={raw.get('use_rslora')}, "
            f"use_dora={raw.get('use_dora')}; only plain LoRA adapters (peft_type='LORA') can be loaded"
        )
    name_map = name_map or {}
    inverse = {v: k for k, v in name_map.items()}
    targets = raw["target_modules"]
    targets = [inverse.get(t, t) for t in (targets if isinstance(targets, list) else [targets])]
    config = LoRAConfig(
        rank=raw["r"], alpha=raw["lora_alpha"], dropout=raw.get("lora_dropout", 0.0), target_modules=targets
    )
    if not lora_modules(model):
        apply_lora(model, config, rng_tracker=rng_tracker)
    tensors = load_file(os.path.join(path, WEIGHTS_NAME))
    with torch.no_grad():
        for name, module in lora_modules(model):
            tp = _tp_of(module)
            for factor in ("lora_A", "lora_B"):
                key = f"{_PREFIX}{name_map.get(name, name)}.{factor}.weight"
                param = getattr(module, factor).weight
                meta = get_parameter_meta(param)
                if key not in tensors or tuple(tensors[key].shape) != meta.logical_shape:
                    found = tuple(tensors[key].shape) if key in tensors else "missing"
                    raise ValueError(f"{path}: tensor {key!r} is {found}; expected shape {meta.logical_shape}")
                full = tensors[key]
                if meta.parallel_dim is not None and tp.size > 1:
                    padded = param.shape[meta.parallel_dim] * tp.size
                    pad = list(full.shape)
                    pad[meta.parallel_dim] = padded - full.shape[meta.parallel_dim]
                    full = torch.cat([full, full.new_zeros(pad)], dim=meta.parallel_dim)
                    full = full.chunk(tp.size, dim=meta.parallel_dim)[tp.rank]
                param.copy_(full)
    return config
