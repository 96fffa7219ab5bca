"""Parity: unmodified tiny Llama / GPT-2 trained with the plain loop, dp2·tp2, pp2·dp2, cp2·dp2, cp2·tp2 and cp2·pp2 vs one process."""

from __future__ import annotations

import pytest
import torch
from auto_models import reference_losses, train_worker

from scaling.testing import run_distributed

LAYOUTS = {
    "dp2_tp2": {"data_parallel_size": 2, "tensor_parallel.size": 2},
    # GPT-2's LM head is tied to the input embedding: held by both stages, gradients summed
    "pp2_dp2": {"data_parallel_size": 2, "pipeline_parallel.size": 2, "pipeline_parallel.num_micro_batches": 2},
    # Context parallelism: each sequence split over 2 ranks (zigzag), attention by ring / all-to-all
    "cp2_dp2": {"data_parallel_size": 2, "context_parallel.size": 2},
    "cp2_tp2_all_to_all": {
        "tensor_parallel.size": 2,
        "context_parallel.size": 2,
        "context_parallel.method": "all_to_all",
    },
    "cp2_pp2": {"context_parallel.size": 2, "pipeline_parallel.size": 2, "pipeline_parallel.num_micro_batches": 2},
}


# The context-parallel layouts run in the slow tier (the quick tier stays under 2 minutes).
QUICK = {"dp2_tp2", "pp2_dp2"}


@pytest.mark.parametrize(
    ("name", "layout"),
    [
        pytest.param(
            name, layout, marks=() if layout in QUICK or (name, layout) == ("llama", "cp2_dp2") else pytest.mark.slow
        )
        for name in ("llama", "gpt2")
        for layout in sorted(LAYOUTS)
    ],
)
def test_layout_matches_one_process(name: str, layout: str) -> None:
    expected = reference_losses(name)
    results = run_distributed(train_worker, 4, name, LAYOUTS[layout], timeout_seconds=420)
    for losses in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0.0)
    assert expected[-1] < expected[0]  # it trains


@pytest.mark.parametrize(
    "layout",
    ["cp2", pytest.param("cp2_pp2", marks=pytest.mark.slow)],
)
def test_under_context_parallelism_loss_item_is_the_batch_loss_on_every_rank(layout: str) -> None:
    """At cp2 each rank computes half of each sequence; what ``model(batch)`` returns prints the
    whole batch's loss (it printed the rank's share: 4.65 where the loss was 5.61), pipelined too,
    and training is unchanged (the one-process losses step by step)."""
    constraints = {"context_parallel.size": 2} if layout == "cp2" else LAYOUTS["cp2_pp2"]
    expected = reference_losses("llama")
    world = 2 if layout == "cp2" else 4
    for losses in run_distributed(train_worker, world, "llama", constraints, False, True, timeout_seconds=300):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0.0)


def test_static_shapes_pp2_dp2_matches_one_process() -> None:
    # Llama's stage messages carry several tensors: after the handshake they go as one
    # payload frame without a header (pipeline_parallel.static_shapes).
    constraints = {**LAYOUTS["pp2_dp2"], "pipeline_parallel.static_shapes": True}
    expected = reference_losses("llama")
    for losses in run_distributed(train_worker, 4, "llama", constraints, timeout_seconds=420):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0.0)


@pytest.mark.slow
def test_compiled_blocks_dp2_tp2_match_one_process() -> None:
    """parallelize(compile=...): each block of the tiny Llama compiled (aot_eager), the TP linears'
    collectives at graph breaks; the plain loop's losses stay those of one eager process."""
    compile = {"enabled": True, "backend": "aot_eager"}
    expected = reference_losses("llama")
    for losses in run_distributed(train_worker, 4, "llama", LAYOUTS["dp2_tp2"], compile, timeout_seconds=420):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0.0)


def eval_worker(name: str, constraints: dict) -> tuple[float, bool]:
    """The model's loss on one batch after ``model.eval()`` (no gradient anywhere afterwards)."""
    from auto_models import GLOBAL_BATCH, MODELS, TokenDataset, lr_scheduler_fn, optimizer_fn

    from scaling.trainer.auto import deferred_init, generate_plan, parallelize

    cls, config = MODELS[name]
    model = deferred_init(cls, config())
    plan = generate_plan(model, {**constraints, "global_batch_size": GLOBAL_BATCH, "seed": 7})
    model, *_ = parallelize(plan, model, optimizer_fn, lr_scheduler_fn, TokenDataset())
    model.eval()
    loss = model(TokenDataset()[0:GLOBAL_BATCH])
    untouched = not loss.requires_grad and all(p.grad is None for p in model.parameters())
    return loss.item(), untouched


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_pipelined_model_evaluates_with_the_one_process_loss(name: str) -> None:
    """``model.eval()`` then ``model(batch)`` under pp2 (it raised "runs training steps only"): the
    forward-only schedule, the one-process loss on both stages, no gradient accumulated."""
    from auto_models import GLOBAL_BATCH, MODELS, TokenDataset

    from scaling.trainer.auto import deferred_init, materialize

    cls, config = MODELS[name]
    reference = materialize(deferred_init(cls, config()), seed=7).eval()
    with torch.no_grad():
        expected = reference(**TokenDataset()[0:GLOBAL_BATCH]).loss.item()
    layout = {"pipeline_parallel.size": 2, "pipeline_parallel.num_micro_batches": 2}
    for loss, untouched in run_distributed(eval_worker, 2, name, layout, timeout_seconds=300):
        assert loss == pytest.approx(expected, rel=1e-5) and untouched
