"""Rotary position embeddings, the KV cache, and masks for packed sequences.

Shape legend: b batch, h heads, s query length, k key length, d head dim.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch

ROPE_SCALING_TYPES = ("linear", "llama3", "yarn")


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class RopeScaling:
    """Frequency scaling of RoPE for contexts longer than pretraining (HF's ``rope_parameters``).

    Attributes:
        rope_type: ``"linear"`` (every frequency divided by ``factor``: position
            interpolation), ``"llama3"`` (Llama 3.1+: wavelengths longer than
            ``original_max_position_embeddings / low_freq_factor`` divided by ``factor``,
            those shorter than ``original_max_position_embeddings / high_freq_factor``
            kept, and a smooth blend in between) or ``"yarn"`` (YaRN, DeepSeek-V3 and Qwen's
            long contexts: frequencies with fewer than ``beta_slow`` turns over the pretraining
            context divided by ``factor``, more than ``beta_fast`` kept, a linear ramp in
            between; cos and sin times :meth:`attention_factor`).
        factor: how much longer the context is than the pretraining one; > 0.
        low_freq_factor, high_freq_factor: the band edges (``"llama3"`` only);
            ``high_freq_factor > low_freq_factor > 0``.
        original_max_position_embeddings: the pretraining context (``"llama3"``, ``"yarn"``).
        beta_fast, beta_slow, mscale, mscale_all_dim, attention_factor, truncate: YaRN's, as
            transformers names them (``attention_factor`` None: from ``factor`` and the mscales).

    Raises:
        ValueError: an unknown ``rope_type`` or a value outside its range (named).

    Example::

        RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)  # Llama 3.1
    """

    rope_type: str = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_SCALING_TYPES:
            raise ValueError(f"RopeScaling: rope_type={self.rope_type!r}; choose one of {ROPE_SCALING_TYPES}")
        if not self.factor > 0:
            raise ValueError(f"RopeScaling: factor={self.factor} must be > 0")
        if self.rope_type == "llama3" and not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                f"RopeScaling: low_freq_factor={self.low_freq_factor}, high_freq_factor={self.high_freq_factor}; "
                "llama3 scaling needs 0 < low_freq_factor < high_freq_factor"
            )
        if self.original_max_position_embeddings < 1:
            raise ValueError(
                f"RopeScaling: original_max_position_embeddings={self.original_max_position_embeddings} must be >= 1"
            )

    def inverse_frequencies(self, base: float, dim: int) -> torch.Tensor:
        """The scaled inverse frequencies of ``dim`` rotated channels (float64, ``[dim / 2]``)."""
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        if self.rope_type == "linear":
            return inv_freq / self.factor
        context = self.original_max_position_embeddings
        if self.rope_type == "yarn":
            # The channel index at which a frequency makes ``turns`` rotations over the context.
            def channel(turns: float) -> float:
                return dim * math.log(context / (turns * 2 * math.pi)) / (2 * math.log(base))

            low, high = channel(self.beta_fast), channel(self.beta_slow)
            if self.truncate:
                low, high = math.floor(low), math.ceil(high)
            low, high = max(low, 0), min(high, dim - 1)
            ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / max(high - low, 0.001)).clamp(0, 1)
            return inv_freq / self.factor * ramp + inv_freq * (1 - ramp)
        wavelength = 2 * math.pi / inv_freq
        long = wavelength > context / self.low_freq_factor
        short = wavelength < context / self.high_freq_factor
        # 0 at the long-wavelength edge of the band, 1 at the short one.
        smooth = (context / wavelength - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        blended = (1 - smooth) * inv_freq / self.factor + smooth * inv_freq
        return torch.where(long, inv_freq / self.factor, torch.where(short, inv_freq, blended))

    def cos_sin_factor(self) -> float:
        """What cos and sin are multiplied by (YaRN's attention factor; 1 for the other types)."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return _yarn_mscale(self.factor, self.mscale) / _yarn_mscale(self.factor, self.mscale_all_dim)
        return _yarn_mscale(self.factor)

    def softmax_scale_factor(self) -> float:
        """DeepSeek's YaRN softmax-scale correction (``mscale_all_dim``), squared; 1 without it."""
        if self.rope_type != "yarn" or not self.mscale_all_dim:
            return 1.0
        return _yarn_mscale(self.factor, self.mscale_all_dim) ** 2


class RotaryEmbedding(torch.nn.Module):
    """Rotary position embedding on the first ``rotary_dim`` channels of each head.

    Args:
        head_dim: channels per head.
        rotary_percentage: fraction of ``head_dim`` that is rotated (GPT-NeoX's
            ``rotary_pct``); rounded down to an even number of channels.
        base: frequency base (``theta``).
        interleaved: rotate channel pairs ``(0, 1), (2, 3), ...`` (GPT-J / Meta Llama
            checkpoints) instead of the half-split pairs ``(i, i + r/2)`` (GPT-NeoX / HF Llama).
        scaling: frequency scaling for long contexts (:class:`RopeScaling`); None: none.

    Raises:
        ValueError: when ``rotary_percentage`` is outside ``(0, 1]`` or leaves no channel.
    """

    inv_freq: torch.Tensor  # registered buffer

    def __init__(
        self,
        head_dim: int,
        rotary_percentage: float = 1.0,
        base: float = 10000.0,
        interleaved: bool = False,
        scaling: RopeScaling | None = None,
    ) -> None:
        super().__init__()
        rotary_dim = int(head_dim * rotary_percentage)
        rotary_dim -= rotary_dim % 2
        if not 0.0 < rotary_percentage <= 1.0 or rotary_dim == 0:
            raise ValueError(
                f"RotaryEmbedding: rotary_percentage={rotary_percentage} with head_dim={head_dim} rotates "
                f"{rotary_dim} channels; choose a value in (0, 1] that leaves at least 2 channels"
            )
        self.rotary_dim = rotary_dim
        self.interleaved = interleaved
        self.base, self.scaling = base, scaling
        if scaling is None:
            inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
        else:
            inv_freq = scaling.inverse_frequencies(base, rotary_dim)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.cos_sin_factor = 1.0 if scaling is None else scaling.cos_sin_factor()

    def forward(self, x_bhsd: torch.Tensor, positions_bs: torch.Tensor) -> torch.Tensor:
        """Rotate ``x_bhsd`` by the angles of ``positions_bs`` (``[b, s]`` or ``[s]`` ints)."""
        if positions_bs.dim() == 1:
            positions_bs = positions_bs.unsqueeze(0)
        angles = positions_bs.to(self.inv_freq.device, torch.float32).unsqueeze(-1) * self.inv_freq
        cos = angles.cos().unsqueeze(1)  # [b, 1, s, r/2]
        sin = angles.sin().unsqueeze(1)
        if self.cos_sin_factor != 1.0:  # YaRN
            cos, sin = cos * self.cos_sin_factor, sin * self.cos_sin_factor
        r = self.rotary_dim
        # Whole heads rotated (the usual case): no slice and no concatenation with an empty
        # pass-through part, each of which costs a full copy in the forward or the backward.
        whole = r == x_bhsd.shape[-1]
        x_rot = (x_bhsd if whole else x_bhsd[..., :r]).float()
        if self.interleaved:
            x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
            rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        else:
            x1, x2 = x_rot[..., : r // 2], x_rot[..., r // 2 :]
            rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        rotated = rotated.to(x_bhsd.dtype)
        return rotated if whole else torch.cat((rotated, x_bhsd[..., r:]), dim=-1)

    def extra_repr(self) -> str:
        scaling = "" if self.scaling is None else f", scaling={self.scaling}"
        return f"rotary_dim={self.rotary_dim}, base={self.base}, interleaved={self.interleaved}{scaling}"


class KVCache:
    """Keys and values of the tokens seen so far, for one attention layer during generation.

    Example::

        caches = [KVCache() for _ in layers]
        out = attention(prompt_bsh, kv_cache=caches[i])      # prefill
        out = attention(next_token_b1h, kv_cache=caches[i])  # one token at a time
    """

    def __init__(self) -> None:
        self.key: torch.Tensor | None = None
        self.value: torch.Tensor | None = None

    @property
    def seq_len(self) -> int:
        """Number of cached positions."""
        return 0 if self.key is None else int(self.key.shape[2])

    def update(self, key_bhsd: torch.Tensor, value_bhsd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new keys/values and return all of them."""
        if self.key is None or self.value is None:
            self.key, self.value = key_bhsd, value_bhsd
        else:
            self.key = torch.cat((self.key, key_bhsd), dim=2)
            self.value = torch.cat((self.value, value_bhsd), dim=2)
        return self.key, self.value

    def reset(self) -> None:
        """Forget every cached position."""
        self.key = self.value = None

    def __repr__(self) -> str:
        return f"KVCache(seq_len={self.seq_len})"


def document_ids_and_positions(
    cu_seqlens: torch.Tensor, batch_size: int, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token document index and position-in-document (``[b, s]`` each) of packed sequences.

    ``cu_seqlens`` holds cumulative document lengths over the flattened ``b * s`` tokens,
    as in flash-attention's varlen API: ``[0, len_0, len_0 + len_1, ..., b * s]``. Computed
    on ``cu_seqlens``' device without a host sync (a compiled layer traces it whole); the
    validation reads the values on the host, so it runs eagerly only; eagerly both are done
    once per ``cu_seqlens`` tensor (and batch shape), not in every layer, and every layer gets
    the same result tensors.

    Raises:
        ValueError: when ``cu_seqlens`` does not start at 0, end at ``b * s``, increase,
            or a document crosses a row of the batch (not checked inside a compiled layer).
    """
    cu = cu_seqlens.detach().reshape(-1).long()
    if torch.compiler.is_compiling():
        return _documents(cu, batch_size, seq_len)
    key = (id(cu_seqlens), batch_size, seq_len)
    known = _DOCUMENTS.get(key)
    if known is not None and known[0]() is cu_seqlens:
        return known[1], known[2]
    _check_cu_seqlens(cu, batch_size, seq_len)
    with torch.inference_mode(False):  # kept for later calls, which may record autograd
        doc, positions = _documents(cu, batch_size, seq_len)
    if len(_DOCUMENTS) >= 8:  # the latest batches only (pipelining interleaves a few)
        del _DOCUMENTS[next(iter(_DOCUMENTS))]
    _DOCUMENTS[key] = (weakref.ref(cu_seqlens), doc, positions)
    return doc, positions


def _documents(cu: torch.Tensor, batch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.arange(batch_size * seq_len, device=cu.device)
    # The document of token t: how many boundaries after the first (cu[0] = 0) are <= t (empty documents
    # skipped). Searched in all of cu, not the view cu[1:]: inductor (torch 2.11) cannot lower a sliced view
    # as searchsorted's boundaries.
    doc = torch.searchsorted(cu, tokens, right=True) - 1
    positions = tokens - cu[doc]
    return doc.view(batch_size, seq_len), positions.view(batch_size, seq_len)


# The documents of the latest cu_seqlens tensors, by (id, batch size, length), each with a weak
# reference that says the tensor is still the one: every layer of a forward gets the same
# tensor, and checking it reads it on the host (a device sync on a GPU), so it is checked and
# worked out once per batch, and every layer shares the same document ids (context
# parallelism's ring keys its per-batch blocks by them).
_DOCUMENTS: dict[tuple[int, int, int], tuple[weakref.ref[torch.Tensor], torch.Tensor, torch.Tensor]] = {}


def _check_cu_seqlens(cu: torch.Tensor, batch_size: int, seq_len: int) -> None:
    values = cu.tolist()
    total = batch_size * seq_len
    boundaries = set(values)
    crossing = [r * seq_len for r in range(1, batch_size) if r * seq_len not in boundaries]
    increasing = all(a <= b for a, b in zip(values, values[1:]))
    if len(values) < 2 or values[0] != 0 or values[-1] != total or not increasing or crossing:
        raise ValueError(
            f"cu_seqlens={values} must increase from 0 to batch_size * seq_len = {total} and contain "
            f"every row start (multiples of seq_len={seq_len}); rows crossed by a document: {crossing}"
        )


def packed_attention_mask(doc_ids_bs: torch.Tensor, causal: bool) -> torch.Tensor:
    """Boolean ``[b, 1, s, s]`` mask (True = may attend): same document, and earlier if causal."""
    mask = doc_ids_bs.unsqueeze(-1) == doc_ids_bs.unsqueeze(-2)
    if causal:
        s = doc_ids_bs.shape[-1]
        mask = mask & torch.ones(s, s, dtype=torch.bool, device=mask.device).tril()
    return mask.unsqueeze(1)
