"""FP8 linear layers: the matrix multiplies of column- and row-parallel linears in float8.

Each product ``a @ b`` casts both operands to float8 with a scale that maps their largest
magnitude onto the format's largest finite value, multiplies with ``torch._scaled_mm``
(float8 inputs, fp32 accumulation, output in the activation dtype) and undoes the scales
there: the recipe of torchao's float8 training and Transformer Engine's current scaling.

- Forward ``y = x W^T``: ``x`` and ``W`` in e4m3 (more mantissa), accumulated in the
  tensor cores' fast mode on GPUs (torchao's default for this product).
- Backward ``dx = dy W`` and ``dW = dy^T x``: ``dy`` in e5m2 (more range, the default for
  tensorwise scaling) or e4m3 (rowwise, as torchao's rowwise recipe); ``x`` and ``W`` are
  re-cast from the high-precision copies autograd saved, scaled along the new products'
  rows and columns.
- Scaling ``"tensorwise"``: one scale per operand. ``"rowwise"``: one per row of the left
  operand and per column of the right one (never along the reduced dimension), which
  keeps an outlier row from flattening the others.

Master weights, gradients and optimizer state stay in their own precision: only the
products run in float8. ``torch._scaled_mm`` runs on CPU in recent torch (so the numerics
are tested here) and on CUDA GPUs of compute capability 8.9 and up; every reduced or output
dimension must be a multiple of 16 on CUDA, so the layers' sizes and the tokens of an input
must be (refused on every device alike, so a setup that trains on CPU trains on a GPU). Why our own and not torchao's ``Float8Linear``: see
docs/architecture.md.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Literal, NamedTuple

import torch
from pydantic import Field, field_validator, model_validator

from scaling.config import BaseConfig

if TYPE_CHECKING:
    from scaling.collectives import AutogradContext

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
_FORMATS = {"e4m3": E4M3, "e5m2": E5M2}


class Float8Config(BaseConfig):
    """Which linear layers compute in float8, and how."""

    enabled: bool = Field(False, description="Column- and row-parallel linears multiply in float8.")
    scaling: Literal["tensorwise", "rowwise"] = Field(
        "tensorwise", description="One scale per operand, or per row / column of each product's operands."
    )
    grad_format: Literal["e5m2", "e4m3"] | None = Field(
        None, description="Float8 format of output gradients; None = e5m2 for tensorwise, e4m3 for rowwise."
    )
    exclude: list[str] = Field(
        default_factory=list,
        description="Regexes (re.search) over module names kept in high precision, e.g. ['attention'].",
    )
    min_features: int = Field(
        128,
        ge=16,
        description="Layers whose local input or output size is below this stay in high precision: small "
        "products gain nothing from float8 and lose accuracy.",
    )

    @field_validator("exclude")
    @classmethod
    def _patterns_compile(cls, patterns: list[str]) -> list[str]:
        for pattern in patterns:
            try:
                re.compile(pattern)
            except re.error as err:
                raise ValueError(
                    f"exclude pattern {pattern!r} is not a regular expression ({err}); e.g. 'attention'"
                ) from None
        return patterns

    all_gather: bool = Field(
        False,
        description="Under ZeRO-3, all-gather the float8 linears' weights in float8 (1 byte per element "
        "on the wire instead of 2 or 4), each quantised with one scale from its amax over all shards "
        "(torchtitan's enable_fsdp_float8_all_gather); needs scaling='tensorwise'.",
    )

    @model_validator(mode="after")
    def _check_all_gather(self) -> Float8Config:
        if self.all_gather and self.scaling != "tensorwise":
            raise ValueError(
                f"fp8.all_gather=true needs fp8.scaling='tensorwise' (got {self.scaling!r}): a gathered weight "
                "carries one scale; set scaling='tensorwise' or all_gather=false"
            )
        return self

    @property
    def grad_dtype(self) -> torch.dtype:
        return _FORMATS[self.grad_format or ("e5m2" if self.scaling == "tensorwise" else "e4m3")]


class Float8Weight(NamedTuple):
    """A linear's weight already in float8, handed to its products instead of the weight itself.

    ZeRO-3's float8 all-gather (``Float8Config.all_gather``) gathers each weight quantised
    with one scale and keeps it here (the tensors stay; their memory is filled at each gather
    and freed with the layer), so the products use the gathered bytes as they are instead of
    quantising the weight again (torchtitan hands its float8 all-gather's tensor to the
    matrix multiply likewise). Tensorwise scaling only.
    """

    tensor: torch.Tensor  # the weight's shape, float8 e4m3
    inverse: torch.Tensor  # 0-d fp32: tensor.float() * inverse dequantises


def float8_quantize(t: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` cast to the float8 ``dtype`` with ``amax`` mapped to the format's largest value; and the
    inverse scale (``quantized.float() * inverse`` dequantises). ``amax`` may be a tensor's own
    (see the products here) or one taken over more (ZeRO-3's shards of one weight)."""
    largest = torch.finfo(dtype).max
    scale = largest / amax.float().clamp(min=1e-12)
    return (t.float() * scale).clamp(-largest, largest).to(dtype), scale.reciprocal()


def _scale(t: torch.Tensor, dtype: torch.dtype, dim: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` cast to ``dtype`` with its amax (over all, or along ``dim``) at the format's max; and the inverse scale."""
    magnitude = t.detach().abs()  # in t's dtype: abs and max are exact, so no fp32 copy of t is needed
    amax = magnitude.amax() if dim is None else magnitude.amax(dim=dim, keepdim=True)
    return float8_quantize(t, amax, dtype)


def float8_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    a_dtype: torch.dtype,
    b_dtype: torch.dtype,
    rowwise: bool,
    out_dtype: torch.dtype,
    fast_accum: bool = False,
    b_float8: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``a [m, k] @ b [k, n]`` in float8: ``a`` scaled per row (or whole), ``b`` per column (or whole).

    ``fast_accum``: let the GPU's float8 tensor cores accumulate in their faster, less precise
    mode (torchao's default for the forward product, never for the gradients'); CPU ignores it.
    ``b_float8``: ``b`` already quantised (tensorwise), with its inverse scale; ``b`` is then not read.
    """
    a8, a_inv = _scale(a, a_dtype, -1 if rowwise else None)
    b8, b_inv = b_float8 if b_float8 is not None else _scale(b, b_dtype, 0 if rowwise else None)
    # _scaled_mm takes the left operand row-major and the right one column-major.
    return torch._scaled_mm(
        a8.contiguous(),
        b8.t().contiguous().t(),
        scale_a=a_inv,
        scale_b=b_inv,
        out_dtype=out_dtype,
        use_fast_accum=fast_accum,
    )


class _Float8Linear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: AutogradContext,
        x: torch.Tensor,
        weight: torch.Tensor,
        weight8: torch.Tensor | None,
        inverse: torch.Tensor | None,
        config: Float8Config,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight, weight8, inverse)
        ctx.config = config
        x2 = x.reshape(-1, x.shape[-1])
        if x2.shape[0] % 16:
            raise ValueError(
                f"float8 linear: an input of {x2.shape[0]} tokens (rows); float8 products need a multiple of 16 "
                "(the weight gradient sums over the tokens, and CUDA's float8 matrix multiply takes only multiples "
                "of 16): make the tokens per micro-batch and rank (micro-batch size x sequence length / context "
                "parallel size) a multiple of 16, or keep this layer in high precision"
            )
        given = None if weight8 is None or inverse is None else (weight8.t(), inverse)
        y = float8_mm(x2, weight.t(), E4M3, E4M3, config.scaling == "rowwise", x.dtype, fast_accum=True, b_float8=given)
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(
        ctx: AutogradContext, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None]:
        x, weight, weight8, inverse = ctx.saved_tensors
        config: Float8Config = ctx.config
        rowwise = config.scaling == "rowwise"
        g2 = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            given = None if weight8 is None else (weight8, inverse)
            grad_x = float8_mm(g2, weight, config.grad_dtype, E4M3, rowwise, grad.dtype, b_float8=given).view(x.shape)
        if ctx.needs_input_grad[1]:
            x2 = x.reshape(-1, x.shape[-1])
            grad_w = float8_mm(g2.t(), x2, config.grad_dtype, E4M3, rowwise, weight.dtype)
        return grad_x, grad_w, None, None, None


def float8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: Float8Config | None,
    weight8: Float8Weight | None = None,
) -> torch.Tensor:
    """``x W^T + b`` with the product in float8 under ``config`` (``F.linear`` when None).

    ``weight8``: the weight already in float8 (ZeRO-3's float8 all-gather), used by the
    products in its place; tensorwise scaling only.
    """
    if config is None:
        return torch.nn.functional.linear(x, weight, bias)
    if weight8 is not None and config.scaling != "tensorwise":
        raise ValueError(f"a weight given in float8 carries one scale; scaling={config.scaling!r} needs the weight")
    data, inverse = (None, None) if weight8 is None else weight8
    y = _Float8Linear.apply(x, weight, data, inverse, config)
    return y + bias if bias is not None else y


def float8_supported(device: torch.device, scaling: str = "tensorwise") -> str | None:
    """None when float8 matrix multiplies with ``scaling`` ("tensorwise" or "rowwise") run on
    ``device`` with this torch; else why not. CUDA: by compute capability only (the ``gpu``
    tier multiplies with both scalings on the card); elsewhere by a 16 x 16 product on the
    device (torch 2.11 on CPU, say, multiplies tensorwise but not rowwise)."""
    if not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
        return f"torch {torch.__version__} has no float8 matrix multiply (torch._scaled_mm)"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return "CUDA is not available"
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            return f"the GPU's compute capability is {major}.{minor}; float8 needs 8.9 (Ada, Hopper) or newer"
        return None
    one = torch.ones(16, 16, device=device).to(E4M3)
    rows, cols = ((16, 1), (1, 16)) if scaling == "rowwise" else ((), ())
    try:
        torch._scaled_mm(
            one,
            one.t(),
            scale_a=torch.ones(rows, device=device),
            scale_b=torch.ones(cols, device=device),
            out_dtype=torch.float32,
        )
    except (RuntimeError, NotImplementedError) as err:
        first = str(err).splitlines()[0].split(". ")[0][:200]  # torch's first sentence, not its backend list
        return f"torch {torch.__version__} cannot multiply float8 {scaling} on {device.type} ({first})"
    return None
