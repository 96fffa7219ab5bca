"""The ``megatron`` sharding policy: recognise column/row pairs in unmodified models.

Recognised blocks (by child names, so renamed classes still match):
``gate_proj``/``up_proj`` -> ``down_proj`` (Llama MLP), ``q_proj``/``k_proj``/``v_proj``
-> ``o_proj`` (Llama attention), ``c_attn`` -> ``c_proj`` (GPT-2 attention, ``Conv1D``
with ``[in, out]`` weights and a fused q/k/v output), ``c_fc`` -> ``c_proj`` (GPT-2 MLP).
The input embedding is split over the vocabulary, and so is the LM head (logits
gathered). Everything else is replicated.
"""

from __future__ import annotations

from typing import cast

import torch

from scaling.trainer.auto._plan import TP_STYLES, ModuleSharding

_PAIRS = (
    (("gate_proj", "up_proj"), "down_proj"),
    (("q_proj", "k_proj", "v_proj"), "o_proj"),
    (("c_fc",), "c_proj"),
)


def is_conv1d(module: torch.nn.Module) -> bool:
    """``transformers``' ``Conv1D``: a linear layer with a ``[in, out]`` weight."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def _is_linear(module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.Linear) or is_conv1d(module)


def out_in(module: torch.nn.Module) -> tuple[int, int]:
    """``(out_features, in_features)`` of a linear or ``Conv1D`` module."""
    w = module.get_parameter("weight")
    return (w.shape[1], w.shape[0]) if is_conv1d(module) else (w.shape[0], w.shape[1])


def _linear(module: torch.nn.Module, style: str, **kw: object) -> ModuleSharding:
    return ModuleSharding(style=style, transposed=is_conv1d(module), **kw)  # type: ignore[arg-type]


def _block(path: str, module: torch.nn.Module) -> dict[str, ModuleSharding]:
    children = dict(module.named_children())
    prefix = f"{path}." if path else ""
    if "c_attn" in children and "c_proj" in children and hasattr(module, "split_size"):
        c_attn = children["c_attn"]
        # GPT-2 attention's plain int attribute, which nn.Module.__getattr__ types as Tensor | Module.
        chunks = out_in(c_attn)[0] // cast(int, module.split_size)
        return {
            prefix + "c_attn": _linear(
                c_attn, "column_fused", chunks=chunks, attributes={"split_size": module.split_size}
            ),
            prefix + "c_proj": _linear(children["c_proj"], "row"),
        }
    for cols, row in _PAIRS:
        if all(c in children and _is_linear(children[c]) for c in (*cols, row)):
            out = {prefix + c: _linear(children[c], "column") for c in cols}
            out[prefix + row] = _linear(children[row], "row")
            return out
    return {}


def megatron_policy(model: torch.nn.Module) -> dict[str, ModuleSharding]:
    """``{module_path: ModuleSharding}`` for the column/row pairs and vocab layers of ``model``."""
    styles: dict[str, ModuleSharding] = {}
    for path, module in model.named_modules():
        styles.update(_block(path, module))
    names = {id(m): p for p, m in model.named_modules()}
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    emb = get_in() if callable(get_in) else None
    head = get_out() if callable(get_out) else None
    if emb is None:
        embeddings = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
        emb = max(embeddings, key=lambda m: m.num_embeddings, default=None)
    if isinstance(emb, torch.nn.Embedding) and id(emb) in names:
        styles[names[id(emb)]] = ModuleSharding(style="vocab")
    if head is not None and _is_linear(head) and id(head) in names:
        styles[names[id(head)]] = _linear(head, "vocab_head")
    return styles


def apply_overrides(
    model: torch.nn.Module, styles: dict[str, ModuleSharding], overrides: dict[str, str]
) -> dict[str, ModuleSharding]:
    """Apply ``{module_path: style or "replicate"}`` overrides.

    Raises:
        ValueError: an unknown path or style, or a style the module cannot take.
    """
    modules = dict(model.named_modules())
    out = dict(styles)
    for path, style in overrides.items():
        if path not in modules:
            raise ValueError(f"tensor_parallel.overrides: no module {path!r} in the model")
        if style == "replicate":
            out.pop(path, None)
            continue
        if style not in TP_STYLES or style == "column_fused":
            raise ValueError(
                f"tensor_parallel.overrides[{path!r}]={style!r} is not a valid style; "
                f"choose one of {[s for s in TP_STYLES if s != 'column_fused'] + ['replicate']}"
            )
        module = modules[path]
        if style == "vocab" and not isinstance(module, torch.nn.Embedding):
            raise ValueError(
                f"tensor_parallel.overrides[{path!r}]='vocab' needs an nn.Embedding, got {type(module).__name__}"
            )
        if style != "vocab" and not _is_linear(module):
            raise ValueError(
                f"tensor_parallel.overrides[{path!r}]={style!r} needs nn.Linear or Conv1D, got {type(module).__name__}"
            )
        out[path] = ModuleSharding(style="vocab") if style == "vocab" else _linear(module, style)
    return out


def shard_dim(sharding: ModuleSharding, param_name: str) -> int | None:
    """The dim of parameter ``param_name`` (``weight``/``bias``) split over TP, or None."""
    style, t = sharding.style, sharding.transposed
    if param_name == "bias":
        return None if style == "row" else 0
    if style == "vocab":
        return 0
    if style == "row":
        return 0 if t else 1
    return 1 if t else 0


def check_divisible(path: str, module: torch.nn.Module, sharding: ModuleSharding, tp: int) -> None:
    """Raise when ``tp`` does not divide the dims (or heads) ``sharding`` splits."""
    if isinstance(module, torch.nn.Embedding):
        size, what = module.num_embeddings, "num_embeddings (vocabulary)"
    else:
        out_f, in_f = out_in(module)
        size, what = (in_f, "in_features") if sharding.style == "row" else (out_f // sharding.chunks, "out_features")
    if size % tp:
        ok = [d for d in range(1, size + 1) if size % d == 0 and d <= 64]
        raise ValueError(
            f"tensor_parallel.size={tp} does not divide {path} {what}={size} ({sharding.style}-parallel, "
            f"{type(module).__name__}); choose one of {ok} or replicate it with tensor_parallel.overrides"
        )
