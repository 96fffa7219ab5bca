"""The numerics bisector on the high-level API: an unmodified Llama at dp2·tp2 (the user's AdamW
updating) and at dp2·ZeRO-1 (scaling.optim updating) agrees with the plain one-process loop module
by module, and a gradient lost in one projection is named there on step 1."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from auto_models import GLOBAL_BATCH, MODELS, TokenDataset, lr_scheduler_fn, optimizer_fn

from scaling.testing import run_distributed
from scaling.trainer.auto import deferred_init, generate_plan, parallelize
from scaling.trainer.numerics import NumericsRecorder, Trace, compare

STEPS = 2
HALVED = "model.layers.1.self_attn.o_proj.weight"


def record_worker(constraints: dict[str, Any], halve: bool = False) -> Trace | None:
    model = deferred_init(MODELS["llama"][0], MODELS["llama"][1]())
    plan = generate_plan(model, {**constraints, "global_batch_size": GLOBAL_BATCH, "seed": 7})
    model, optimizer, scheduler, loader = parallelize(plan, model, optimizer_fn, lr_scheduler_fn, TokenDataset())
    if halve:  # an injected bug: this weight's gradient halved in backward
        model.module.get_parameter(HALVED).register_hook(lambda g: g * 0.5)
    batches = iter(loader)

    def step() -> float:
        optimizer.zero_grad()
        loss = model(next(batches))
        loss.backward()
        optimizer.step()
        scheduler.step()
        return model.global_loss(loss)

    return NumericsRecorder.of_model(model, optimizer, step).run(STEPS)


@pytest.fixture(scope="module")
def one_process() -> Trace:
    (trace,) = run_distributed(record_worker, 1, {}, timeout_seconds=120)
    assert trace is not None
    return trace


PP2 = {"data_parallel_size": 2, "pipeline_parallel.size": 2, "pipeline_parallel.num_micro_batches": 2}


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("constraints", "world", "unmatched"),
    [
        ({"data_parallel_size": 2, "tensor_parallel.size": 2}, 4, set()),
        ({"data_parallel_size": 2, "zero_stage": 1}, 2, set()),
        pytest.param({"data_parallel_size": 2, "zero_stage": 3}, 2, set(), marks=pytest.mark.slow),
        # the first stage's last block ends its forward by raising (its output goes to the next stage)
        pytest.param(PP2, 4, {"model.layers.0"}, marks=pytest.mark.slow),
        # attention's weights output is None under context parallelism
        pytest.param(
            {"data_parallel_size": 2, "context_parallel.size": 2},
            4,
            {"model.layers.0.self_attn/1", "model.layers.1.self_attn/1"},
            marks=pytest.mark.slow,
        ),
    ],
    ids=["dp2-tp2", "dp2-zero1", "dp2-zero3", "pp2-dp2", "cp2-dp2"],
)
def test_a_parallelized_model_agrees_with_the_plain_loop_module_by_module(one_process, constraints, world, unmatched):
    (trace,) = run_distributed(record_worker, world, constraints, timeout_seconds=300)[:1]
    report = compare(one_process, trace)
    assert report.first is None and report.compared > 50, report.describe()
    assert set(report.only_in_one) == unmatched, report.describe()
    names = [name for _, name in one_process.steps[0].activations]
    # The unmodified model's names, the embedding first and the head last in the forward.
    assert names[0] == "model.embed_tokens" and "model.layers.1.self_attn.o_proj" in names
    assert set(one_process.steps[0].gradients) == {n for n, p in _llama().named_parameters()}


@pytest.mark.distributed
def test_a_halved_gradient_is_named_at_its_weight(one_process):
    (trace,) = run_distributed(record_worker, 4, {"data_parallel_size": 2, "tensor_parallel.size": 2}, True)[:1]
    first = compare(one_process, trace).first
    assert first is not None and (first.step, first.quantity, first.name) == (1, "gradient", HALVED)


def _llama() -> torch.nn.Module:
    return MODELS["llama"][0](MODELS["llama"][1]())
