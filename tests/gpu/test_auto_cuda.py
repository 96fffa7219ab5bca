"""The auto API (``scaling.trainer.auto``) on one GPU: an unmodified transformers model, the plain loop.

``parallelize`` on a running NCCL group puts the model on this rank's GPU, hands back a loader
of pinned batches, and ``model(batch)`` copies each batch to the GPU; the CPU tests of the same
API (packages/scaling-trainer/tests/auto) run the same code with the CPU as the device.
"""

import pytest
import torch
from auto_models import GLOBAL_BATCH, MODELS, TokenDataset, lr_scheduler_fn, optimizer_fn, plain_loop, reference_losses

from scaling.testing import run_distributed

pytestmark = pytest.mark.gpu


def _auto_worker(constraints: dict) -> tuple[list[float], set[str], bool]:
    from scaling.trainer.auto import deferred_init, generate_plan, parallelize

    cls, config = MODELS["llama"]
    model = deferred_init(cls, config())
    plan = generate_plan(model, {**constraints, "global_batch_size": GLOBAL_BATCH, "seed": 7})
    model, optimizer, scheduler, loader = parallelize(plan, model, optimizer_fn, lr_scheduler_fn, TokenDataset())
    pinned = next(iter(loader))["input_ids"].is_pinned()
    losses = plain_loop(model, optimizer, scheduler, loader)
    return losses, {str(p.device) for p in model.parameters()}, pinned


def test_auto_api_trains_an_unmodified_model_on_cuda_as_on_cpu():
    ((losses, devices, pinned),) = run_distributed(_auto_worker, 1, {}, backend="nccl", timeout_seconds=300)
    assert devices == {"cuda:0"} and pinned
    # fp32 on both (cuBLAS without TF32, torch's default): the CPU run's losses within 1e-4.
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference_losses("llama")), rtol=1e-4, atol=0.0)


def test_auto_api_with_zero3_in_bf16_on_cuda_trains():
    ((losses, devices, _),) = run_distributed(
        _auto_worker, 1, {"zero_stage": 3, "precision": "bfloat16"}, backend="nccl", timeout_seconds=300
    )
    assert devices == {"cuda:0"}
    assert losses[-1] < losses[0], losses
