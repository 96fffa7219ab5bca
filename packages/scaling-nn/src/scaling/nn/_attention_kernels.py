"""Fused attention kernels that torch runs behind SDPA, called directly where Scaling needs
more than SDPA gives, each chosen by device, dtype and mask (shape legend as ``_attention``:
b batch, n heads, s tokens, d head dim).

- One block of ring attention and its log-sum-exp (:func:`block_attention_forward`), and its
  gradients given the merged output and log-sum-exp (:func:`block_attention_backward`): on CPU
  torch's flash kernel, on CUDA the flash or the memory-efficient one, elsewhere the block
  written out in fp32 (:func:`math_attention_forward`).
- Packed documents on CUDA by flash attention's variable-length kernel
  (:func:`packed_flash_attention`).

CI traces the CUDA calls on the meta device; the ``gpu`` tier checks their values.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from scaling.collectives import AutogradContext


def _bias(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def _unit_stride(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Each tensor with a head dim of stride 1 (copied only when it is not): the fused kernels
    assume it and read other memory otherwise (``F.scaled_dot_product_attention`` checks it
    before choosing them; called directly, they do not). A head dim of one or two channels
    rotated by RoPE can come out of ``torch.cat`` with another stride."""
    return [t if t.stride(-1) == 1 else t.contiguous() for t in tensors]


def _causal(sq: int, sk: int, device: torch.device) -> torch.Tensor:
    return torch.ones(sq, sk, dtype=torch.bool, device=device).tril()


def block_attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    scale: float,
    kernel: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one block and its log-sum-exp: ``(out [b, n, sq, d], lse [b, n, sq] fp32)``.

    ``k``/``v`` have as many heads as ``q``; ``mask`` is bool ``[b | 1, 1, sq, sk]`` or None.
    Every query row must see at least one key. ``kernel``: a fused kernel that returns the
    log-sum-exp (None: :func:`_kernel` chooses by device, dtype and mask), or "math"
    (:func:`math_attention_forward`).
    """
    kernel = kernel or _kernel(q, mask)
    if kernel != "math":
        q, k, v = _unit_stride(q, k, v)
    if kernel == "cpu_flash":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=_bias(mask, q.dtype), scale=scale
        )
        return out, lse
    if kernel == "flash":
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return out, lse
    if kernel == "efficient":
        out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, _aligned_bias(mask, q), True, 0.0, causal, scale=scale
        )
        return out, lse[:, :, : q.shape[2]]  # the CUDA kernel pads its rows to a multiple of 32
    return math_attention_forward(q, k, v, mask, causal, scale)


def block_attention_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    scale: float,
    kernel: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block given the *merged* output and log-sum-exp of its rows.

    With the final ``out`` and ``lse`` the softmax of the block is the block's share of
    the whole row's softmax, so the block's gradients are exact parts of the whole (the
    fused kernels take ``out`` and ``lse`` as inputs, so they compute exactly that). The
    CUDA kernels read the log-sum-exp with a row stride of 1, so it is made contiguous (the
    efficient one's in its forward's padded layout); without dropout neither reads its
    random-number state.
    """
    kernel = kernel or _kernel(q, mask)
    if kernel != "math":
        grad_out, q, k, v, out = _unit_stride(grad_out, q, k, v, out)
    if kernel == "cpu_flash":
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, causal, attn_mask=_bias(mask, q.dtype), scale=scale
        )
        return dq, dk, dv
    if kernel not in ("flash", "efficient"):
        return math_attention_backward(grad_out, q, k, v, out, lse, mask, causal, scale)
    sq, no_rng = q.shape[2], torch.empty((), dtype=torch.long, device=q.device)
    if kernel == "flash":
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad_out, q, k, v, out, lse.contiguous(), None, None, sq, k.shape[2], 0.0, causal, no_rng, no_rng,
            scale=scale,
        )  # fmt: skip
        return dq, dk, dv
    padded = lse.new_zeros(*lse.shape[:2], -(-sq // 32) * 32)
    padded[:, :, :sq] = lse
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        grad_out, q, k, v, _aligned_bias(mask, q), out, padded, no_rng, no_rng, 0.0, [True, True, True, False],
        causal, scale=scale,
    )  # fmt: skip
    return dq, dk, dv


def _kernel(q: torch.Tensor, mask: torch.Tensor | None) -> str:
    """The kernel for a block of ``q``: on CPU torch's flash kernel ("cpu_flash", any mask); on
    CUDA the flash kernel ("flash") for fp16/bf16 blocks without a mask (compute capability 8.0
    and up, head size a multiple of 8 up to 256), else the memory-efficient one ("efficient":
    fp32, or a mask as an additive bias); on other devices "math"."""
    if q.device.type == "cpu":
        return "cpu_flash"
    if q.device.type != "cuda":
        return "math"
    d = q.shape[-1]
    if mask is None and q.dtype in (torch.float16, torch.bfloat16) and d % 8 == 0 and d <= 256:
        if cuda_capability(q.device)[0] >= 8:
            return "flash"
    return "efficient"


def cuda_capability(device: torch.device) -> tuple[int, int]:
    """``torch.cuda.get_device_capability``; inside a compiled layer a constant of the graph, taken
    when it is traced (``compile_layer`` marks it so: the fused kernels' choice reads it, and a
    device does not change; marking it here would import Dynamo with every import of scaling.nn)."""
    return torch.cuda.get_device_capability(device)


def _aligned_bias(mask: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
    """``mask`` as the memory-efficient kernel's additive bias ``[b, n, sq, sk]`` in ``q``'s dtype:
    its rows start at multiples of 16 elements (the kernel's alignment; the rest is padding) and
    broadcast dimensions are expanded, not copied (as ``F.scaled_dot_product_attention`` does)."""
    if mask is None:
        return None
    *lead, sk = mask.shape
    padded = torch.zeros((*lead, -(-sk // 16) * 16), dtype=q.dtype, device=mask.device)
    bias = padded[..., :sk].masked_fill_(~mask, float("-inf"))
    b, n, sq = q.shape[:3]
    return bias.expand(b, n, sq, sk)


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, causal: bool, scale: float) -> torch.Tensor:
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        mask = _causal(q.shape[2], k.shape[2], q.device)
    return scores if mask is None else scores.masked_fill(~mask, float("-inf"))


def math_attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`block_attention_forward` written out in fp32 (any device)."""
    scores = _scores(q, k, mask, causal, scale)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.float())
    return out.to(q.dtype), lse


def math_attention_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`block_attention_backward` written out in fp32 (any device)."""
    g = grad_out.float()
    probs = torch.exp(_scores(q, k, mask, causal, scale) - lse.unsqueeze(-1))
    dv = torch.matmul(probs.transpose(-1, -2), g)
    delta = (g * out.float()).sum(-1, keepdim=True)
    dscores = probs * (torch.matmul(g, v.float().transpose(-1, -2)) - delta) * scale
    dq, dk = torch.matmul(dscores, k.float()), torch.matmul(dscores.transpose(-1, -2), q.float())
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def packed_flash_available(q: torch.Tensor, dropout: float) -> bool:
    """Whether :func:`packed_flash_attention` runs for queries like ``q`` (``[b, n, s, d]``)."""
    d = q.shape[-1]
    if q.device.type != "cuda" or dropout > 0.0 or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    return d % 8 == 0 and d <= 256 and cuda_capability(q.device)[0] >= 8


class _PackedFlash(torch.autograd.Function):
    """Flash attention's variable-length kernel over ``[tokens, heads, d]`` with one ``cu_seqlens``
    for queries and keys (what ``torch.nn.attention.varlen`` calls; its module is not imported:
    in torch 2.10+ it imports DTensor, a second of start-up for every process)."""

    @staticmethod
    def forward(
        ctx: AutogradContext,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu: torch.Tensor,
        longest: int,
        causal: bool,
    ) -> torch.Tensor:
        out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, longest, longest, 0.0, causal, False
        )
        ctx.save_for_backward(q, k, v, out, lse, cu, rng_state, unused)
        ctx.longest, ctx.causal = longest, causal
        return out

    @staticmethod
    def backward(ctx: AutogradContext, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, cu, rng_state, unused = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad.contiguous(), q, k, v, out, lse, cu, cu, ctx.longest, ctx.longest, 0.0, ctx.causal, rng_state, unused
        )
        return dq, dk, dv, None, None, None


def packed_flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, causal: bool
) -> torch.Tensor:
    """Attention within the documents of ``cu_seqlens`` by flash attention's variable-length kernel.

    ``q`` ``[b, n, s, d]``, ``k``/``v`` ``[b, n_kv, s, d]`` (``n_kv`` divides ``n``);
    ``cu_seqlens`` as :func:`document_ids_and_positions` takes it (documents never cross a
    row, so ``s`` bounds every document and no host read of their lengths is needed).
    Returns ``[b, n, s, d]``, what SDPA returns with :func:`packed_attention_mask`.
    """
    b, n, s, d = q.shape
    if k.shape[1] != n:
        k, v = (t.repeat_interleave(n // t.shape[1], dim=1) for t in (k, v))
    q_, k_, v_ = (t.transpose(1, 2).reshape(b * s, n, d) for t in (q, k, v))
    out = _PackedFlash.apply(q_, k_, v_, cu_seqlens.reshape(-1).to(torch.int32), s, causal)
    return out.view(b, s, n, d).transpose(1, 2)
