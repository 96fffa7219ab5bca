"""Sampling from the one-process model: KV cache, greedy, temperature, top-k, top-p, batches of prompts.

Prompts of different lengths are left-padded to a common length; a key padding mask
keeps the padding out of attention and positions count real tokens only, so each row
generates exactly what it would alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch

from scaling.data import load_tokenizer
from scaling.nn import KVCache
from scaling.transformer.config import TransformerConfig
from scaling.transformer.corpus import EOD_TOKEN, default_paths
from scaling.transformer.inference import TransformerLM, load_model


def check_sampling(max_new_tokens: int, temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Refuse sampling arguments that cannot work, naming them (before any model is loaded).

    Raises:
        ValueError: a negative ``max_new_tokens`` or temperature, a non-finite temperature,
            ``top_k < 1`` or ``top_p`` outside ``(0, 1]``.
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0 (--max-new-tokens)")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature={temperature} must be a finite number >= 0 (0 = greedy)")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k={top_k} must be >= 1 (or None for no limit)")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p={top_p} must be in (0, 1] (or None for no limit)")


def sample_next(
    logits_bv: torch.Tensor,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Next token ids ``[b]`` from last-position logits ``[b, V]``.

    ``temperature=0`` is greedy (argmax); otherwise logits are divided by the temperature,
    restricted to the ``top_k`` largest and to the smallest set whose probability reaches
    ``top_p`` (nucleus), and sampled.

    Raises:
        ValueError: for a negative temperature, ``top_k < 1`` or ``top_p`` outside ``(0, 1]``.
    """
    check_sampling(0, temperature, top_k, top_p)
    logits_bv = logits_bv.float()
    if temperature == 0.0:
        return logits_bv.argmax(dim=-1)
    logits_bv = logits_bv / temperature
    if top_k is not None and top_k < logits_bv.shape[-1]:
        kth = logits_bv.topk(top_k, dim=-1).values[:, -1:]
        logits_bv = logits_bv.masked_fill(logits_bv < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits_bv.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop a token when the tokens before it already reach top_p (the first always stays).
        drop_sorted = (cumulative - sorted_logits.softmax(dim=-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits_bv = logits_bv.masked_fill(drop, float("-inf"))
    probs = logits_bv.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model: TransformerLM,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | None = None,
    seed: int = 0,
) -> list[list[int]]:
    """Continue each prompt by up to ``max_new_tokens`` tokens (stopping a row at ``eos_token_id``).

    Returns:
        The new tokens of each prompt (without the prompt; the EOS token is kept).

    Raises:
        ValueError: sampling arguments :func:`check_sampling` refuses, an empty prompt, or prompt +
            new tokens longer than ``max_sequence_length`` (the positions the model was configured for).
    """
    arch = model.arch
    check_sampling(max_new_tokens, temperature, top_k, top_p)
    lengths = [len(p) for p in prompts]
    if not prompts or min(lengths) == 0:
        raise ValueError("every prompt needs at least one token (encode '' with a BOS/EOD token first)")
    longest = max(lengths)
    if longest + max_new_tokens > arch.max_sequence_length:
        raise ValueError(
            f"prompt of {longest} tokens + max_new_tokens={max_new_tokens} = {longest + max_new_tokens} exceeds "
            f"transformer_architecture.max_sequence_length={arch.max_sequence_length}; shorten them"
        )
    b = len(prompts)
    device = next(model.parameters()).device
    ids = torch.zeros(b, longest, dtype=torch.long)
    real = torch.zeros(b, longest + max_new_tokens, dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p) :] = torch.tensor(list(p), dtype=torch.long)
        real[i, longest - len(p) :] = True
    padded = min(lengths) != longest
    caches = [KVCache() for _ in model.blocks]
    generator = torch.Generator().manual_seed(seed)
    out: list[list[int]] = [[] for _ in range(b)]
    done = torch.zeros(b, dtype=torch.bool)
    step_ids, real = ids.to(device), real.to(device)
    for _ in range(max_new_tokens):
        t = caches[0].seq_len + step_ids.shape[1]
        logits = model.forward_cached(step_ids, caches, real[:, :t] if padded else None)
        # Sampled on CPU, so one seed gives the same tokens on every device.
        next_ids = sample_next(logits[:, -1].float().cpu(), temperature, top_k, top_p, generator)
        for i in range(b):
            if not done[i]:
                out[i].append(int(next_ids[i]))
        if eos_token_id is not None:
            done |= next_ids == eos_token_id
            if bool(done.all()):
                break
        step_ids = next_ids.unsqueeze(-1).to(device)
    return out


def generate_text(
    checkpoint: str | Path,
    prompts: Sequence[str],
    tokenizer_path: str | Path | None = None,
    config_path: str | Path | None = None,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
) -> list[str]:
    """Load a checkpoint (any layout), encode ``prompts``, generate, decode prompt + continuation."""
    check_sampling(max_new_tokens, temperature, top_k, top_p)
    for prompt in prompts:
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError:  # invalid UTF-8 bytes on a command line arrive as lone surrogates
            raise ValueError(f"--prompt {prompt!r} is not valid UTF-8; pass text in UTF-8") from None
    config = TransformerConfig.from_yaml(config_path) if config_path is not None else None
    model, config = load_model(checkpoint, config)
    path = tokenizer_path or config.data.tokenizer_path or default_paths(config.data.default_corpus_dir)["tokenizer"]
    if not Path(path).is_file():
        raise FileNotFoundError(f"tokenizer {str(path)!r} not found; pass --tokenizer or run preprocess")
    tokenizer = load_tokenizer(path)
    eod = tokenizer.token_to_id(EOD_TOKEN)
    encoded = [tokenizer.encode(p).ids or ([eod] if eod is not None else []) for p in prompts]
    new = generate(model, encoded, max_new_tokens, temperature, top_k, top_p, eos_token_id=eod, seed=seed)
    return [tokenizer.decode(list(p) + n) for p, n in zip(encoded, new)]
