"""Logits and greedy generation of an unmodified model under every plan equal one process's (#49)."""

from __future__ import annotations

import pytest
import torch
from auto_models import GLOBAL_BATCH, MODELS, TokenDataset, lr_scheduler_fn, optimizer_fn

from scaling.testing import run_distributed
from scaling.trainer.auto import deferred_init, generate_plan, materialize, parallelize

PROMPT, NEW = 4, 4
LAYOUTS = {
    "tp2": ({"tensor_parallel.size": 2}, 2),
    "pp2": ({"pipeline_parallel.size": 2, "pipeline_parallel.num_micro_batches": 2}, 2),
    "cp2": ({"context_parallel.size": 2}, 2),
    "cp2_pp2": ({"context_parallel.size": 2, "pipeline_parallel.size": 2, "pipeline_parallel.num_micro_batches": 2}, 4),
}


def _ids() -> torch.Tensor:
    return TokenDataset()[0:4]["input_ids"]


def inference_worker(name: str, constraints: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Logits of a batch, greedy tokens after its first PROMPT tokens, and (without PP or CP)
    transformers' own ``generate`` on the parallelized module."""
    cls, config = MODELS[name]
    model = deferred_init(cls, config())
    plan = generate_plan(model, {**constraints, "global_batch_size": GLOBAL_BATCH, "seed": 7})
    model, *_ = parallelize(plan, model, optimizer_fn, lr_scheduler_fn, TokenDataset())
    model.eval()
    ids = _ids()
    logits = model.logits({"input_ids": ids}).cpu()
    tokens = model.generate(ids[:, :PROMPT], NEW).cpu()
    own = None
    if plan.pipe_parallel_size == 1 and plan.context_parallel_size == 1:
        prompt = ids[:, :PROMPT].to(model.topology.device)
        own = model.module.generate(prompt, max_new_tokens=NEW, do_sample=False).cpu()
    untouched = all(p.grad is None for p in model.parameters())
    assert untouched, "inference accumulated gradients"
    return logits, tokens, own


def _reference(name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cls, config = MODELS[name]
    model = materialize(deferred_init(cls, config()), seed=7).eval()
    ids = _ids()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        tokens = ids[:, :PROMPT]
        for _ in range(NEW):
            tokens = torch.cat([tokens, model(input_ids=tokens).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        own = model.generate(ids[:, :PROMPT], max_new_tokens=NEW, do_sample=False)
    return logits, tokens, own


@pytest.mark.parametrize(
    ("name", "layout"),
    [
        ("llama", "tp2"),
        ("llama", "pp2"),
        ("llama", "cp2"),
        pytest.param("gpt2", "tp2", marks=pytest.mark.slow),
        pytest.param("gpt2", "pp2", marks=pytest.mark.slow),
        pytest.param("llama", "cp2_pp2", marks=pytest.mark.slow),
    ],
)
def test_logits_and_greedy_tokens_equal_one_process(name: str, layout: str) -> None:
    """``model.logits(batch)`` is the whole batch's logits on every rank (TP: the gathered head; PP:
    the last stage's, broadcast; CP: every rank's zigzag slice put back in order) and
    ``model.generate(ids, n)`` the one-process greedy tokens (CP pads the growing sequence on the
    right); under TP ``model.module.generate`` (transformers' own, with its cache) also matches."""
    constraints, world = LAYOUTS[layout]
    logits, tokens, own = _reference(name)
    for got_logits, got_tokens, got_own in run_distributed(inference_worker, world, name, constraints):
        torch.testing.assert_close(got_logits, logits, rtol=1e-5, atol=1e-5)
        assert torch.equal(got_tokens, tokens)
        if got_own is not None:
            assert torch.equal(got_own, own)
