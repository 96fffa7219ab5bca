"""Tiny transformers models, data and training loops shared by the auto tests."""

from __future__ import annotations

from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from scaling.nn import CompileConfig
from scaling.trainer.auto import deferred_init, generate_plan, materialize, parallelize

VOCAB, SEQ = 64, 8


def llama_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        attn_implementation="eager",
    )


def gpt2_config() -> GPT2Config:
    return GPT2Config(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=SEQ,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="eager",
    )


MODELS = {"llama": (LlamaForCausalLM, llama_config), "gpt2": (GPT2LMHeadModel, gpt2_config)}


class TokenDataset(torch.utils.data.Dataset):
    """Deterministic random token sequences; each item is ``{"input_ids", "labels"}``."""

    def __init__(self, n: int = 80) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def optimizer_fn(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def muon_fn(model: torch.nn.Module) -> torch.optim.Optimizer:
    """torch.optim.Muon (torch >= 2.9) over the matrices; the vectors (norms) stay as they are."""
    matrices = [p for p in model.parameters() if p.ndim == 2]
    return torch.optim.Muon(matrices, lr=1e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")  # type: ignore[attr-defined]


def lr_scheduler_fn(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)


# The plain loop on one process and the same loop parallelized (test_parity, test_zero).
STEPS, GLOBAL_BATCH = 10, 4


def reference_losses(name: str, make_optimizer: Any = optimizer_fn) -> list[float]:
    cls, config = MODELS[name]
    model = materialize(deferred_init(cls, config()), seed=7)
    optimizer = make_optimizer(model)
    scheduler = lr_scheduler_fn(optimizer)
    loader = torch.utils.data.DataLoader(TokenDataset(), batch_size=GLOBAL_BATCH)
    losses = []
    for _, batch in zip(range(STEPS), loader):
        optimizer.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    return losses


def train_worker(
    name: str, constraints: dict, compile: Any = False, raw: bool = False, make_optimizer: Any = optimizer_fn
) -> list[float]:
    cls, config = MODELS[name]
    model = deferred_init(cls, config())
    plan = generate_plan(model, {**constraints, "global_batch_size": GLOBAL_BATCH, "seed": 7})
    model, optimizer, scheduler, loader = parallelize(
        plan,
        model,
        make_optimizer,
        lr_scheduler_fn,
        TokenDataset(),
        compile=CompileConfig(**compile) if compile else False,
    )
    return plain_loop(model, optimizer, scheduler, loader, raw)


def plain_loop(model: Any, optimizer: Any, scheduler: Any, loader: Any, raw: bool = False) -> list[float]:
    """``STEPS`` steps of the plain loop over a parallelized model; the global loss of each (``raw``:
    ``loss.item()`` of what ``model(batch)`` returned)."""
    losses = []
    for _, batch in zip(range(STEPS), loader):
        optimizer.zero_grad()
        loss = model(batch)
        loss.backward()
        optimizer.step()
        scheduler.step()
        # model(batch) is this DP rank's loss (as with DDP); global_loss is what one device logs
        losses.append(loss.item() if raw else model.global_loss(loss))
    return losses
