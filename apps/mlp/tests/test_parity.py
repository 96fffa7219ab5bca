"""The same config on every layout gives the one-process losses (fp32, 1e-5 relative)."""

import pytest
from mlp_testlib import losses, small_config, train_worker

from scaling.testing import assert_parity, run_distributed

STEPS = 20


@pytest.fixture(scope="module")
def reference_losses():
    (history,) = run_distributed(train_worker, 1, small_config(steps=STEPS), timeout_seconds=180)
    out = losses(history)
    assert len(out) == STEPS and out[-1] < out[0]  # it trains
    return out


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("tp", "pp", "dp"),
    [(1, 1, 2), (2, 1, 1), (1, 2, 1), (1, 4, 1), pytest.param(2, 2, 2, marks=pytest.mark.slow)],
    ids=["dp2", "tp2", "pp2", "pp4-two-middle-stages-read-nothing", "dp2-pp2-tp2"],
)
def test_layout_matches_one_process(reference_losses, tp, pp, dp):
    results = run_distributed(train_worker, tp * pp * dp, small_config(tp, pp, dp, steps=STEPS), timeout_seconds=300)
    for rank, history in enumerate(results):
        assert_parity(
            losses(history), reference_losses, rtol=1e-5, name=f"rank {rank} losses at tp={tp} pp={pp} dp={dp}"
        )


@pytest.mark.distributed
def test_pp2_static_shapes_matches_one_process(reference_losses):
    # training.static_shapes: hand-offs without a header; evaluation (its own transport) runs too.
    cfg = small_config(1, 2, 1, steps=STEPS, training={"static_shapes": True}, trainer={"eval_interval": 10})
    for rank, history in enumerate(run_distributed(train_worker, 2, cfg, timeout_seconds=300)):
        assert_parity(losses(history), reference_losses, rtol=1e-5, name=f"rank {rank} losses, static shapes")
        assert sum("evaluation/accuracy" in m for m in history) == 2  # steps 10 and 20


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("tp", "pp", "dp", "optimizer", "shard"),
    [
        (1, 1, 2, {"zero_stage": 3}, None),
        (1, 2, 2, {"zero_stage": 3, "zero3_reshard_after_forward": False}, None),
        (1, 1, 4, {"zero_stage": 3}, 2),  # HSDP: shard over 2, replicate twice
        pytest.param(2, 2, 2, {"zero_stage": 3}, None, marks=pytest.mark.slow),
        pytest.param(1, 2, 4, {"zero_stage": 3}, 2, marks=pytest.mark.slow),
    ],
    ids=["dp2", "dp2-pp2-kept-whole", "hsdp-2x2", "dp2-pp2-tp2", "hsdp-2x2-pp2"],
)
def test_zero3_matches_one_process(reference_losses, tp, pp, dp, optimizer, shard):
    # One config switch: BaseTrainer hands the ParallelModule's layers to the optimizer.
    cfg = small_config(tp, pp, dp, steps=STEPS, optimizer=optimizer)
    cfg["topology"]["data_parallel_shard_size"] = shard
    for rank, history in enumerate(run_distributed(train_worker, tp * pp * dp, cfg, timeout_seconds=300)):
        assert_parity(losses(history), reference_losses, rtol=1e-5, name=f"rank {rank} ZeRO-3 losses at {optimizer}")


@pytest.mark.distributed
@pytest.mark.slow
def test_compiled_3d_layout_matches_one_process(reference_losses):
    """training.compile: each layer compiled (aot_eager backend), the TP regions at graph breaks; with
    evaluation every 10 steps (a no-grad forward compiles its own graphs)."""
    cfg = small_config(
        2,
        2,
        2,
        steps=STEPS,
        training={"compile": {"enabled": True, "backend": "aot_eager"}},
        trainer={"eval_interval": 10},
    )
    for rank, history in enumerate(run_distributed(train_worker, 8, cfg, timeout_seconds=300)):
        assert_parity(losses(history), reference_losses, rtol=1e-5, name=f"rank {rank} compiled losses")
        assert [m for m in history if "training/loss" in m][-1]["compile/graphs"] > 0
