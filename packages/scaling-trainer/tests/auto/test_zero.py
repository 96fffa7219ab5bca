"""ZeRO and precision through the optimizer wrapper: the user's AdamW run by scaling.optim."""

from __future__ import annotations

import warnings

import pytest
import torch
from auto_models import muon_fn, reference_losses, train_worker

from scaling.testing import run_distributed
from scaling.trainer.auto import deferred_init, generate_plan
from scaling.trainer.auto._optimizer import _config


def zero_worker(name: str) -> tuple[list[float], list[float], list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        zero1 = train_worker(name, {"data_parallel_size": 2, "zero_stage": 1})
        bf16 = train_worker(name, {"data_parallel_size": 2, "zero_stage": 1, "precision": "bfloat16"})
    return zero1, bf16, [str(w.message) for w in caught if "lr_scheduler" in str(w.message)]


def test_dp2_zero1_matches_one_process_and_bf16_trains() -> None:
    expected = reference_losses("llama")
    for zero1, bf16, scheduler_warnings in run_distributed(zero_worker, 2, "llama", timeout_seconds=420):
        # The update runs in scaling.optim, not in the user's optimizer: its scheduler must not
        # warn that it stepped before the optimizer did.
        assert scheduler_warnings == []
        torch.testing.assert_close(torch.tensor(zero1), torch.tensor(expected), rtol=1e-5, atol=0.0)
        # bf16 parameters with fp32 master weights: the same curve within bf16 rounding
        torch.testing.assert_close(torch.tensor(bf16), torch.tensor(expected), rtol=3e-2, atol=0.0)
        assert bf16[-1] < bf16[0]


def zero3_worker(name: str, layout: dict) -> list[float]:
    return train_worker(name, {"zero_stage": 3, **layout})


@pytest.mark.parametrize(
    ("name", "layout"),
    [
        ("gpt2", {"data_parallel_size": 2}),  # the LM head tied to the embedding, one unit (the root)
        ("gpt2", {"data_parallel_size": 2, "pipeline_parallel.size": 2}),  # tied across the two stages
        ("llama", {"data_parallel_size": 2, "tensor_parallel.size": 2}),
        ("gpt2", {"data_parallel_size": 4, "data_parallel_shard_size": 2}),  # HSDP 2 x 2
        ("llama", {"data_parallel_size": 2, "cpu_offload": True}),
        # ZeRO-2 keeps the .grad of weights tied across stages (their tied_key) for the stage sum
        pytest.param(
            "gpt2", {"data_parallel_size": 2, "pipeline_parallel.size": 2, "zero_stage": 2}, marks=pytest.mark.slow
        ),
    ],
    ids=["gpt2-dp2", "gpt2-dp2-pp2-tied", "llama-dp2-tp2", "gpt2-hsdp-2x2", "llama-dp2-offload", "zero2-pp2-tied"],
)
def test_zero2_and_3_match_one_process(name: str, layout: dict) -> None:
    expected = reference_losses(name)
    world = (
        layout["data_parallel_size"] * layout.get("pipeline_parallel.size", 1) * layout.get("tensor_parallel.size", 1)
    )
    for losses in run_distributed(zero3_worker, world, name, layout, timeout_seconds=420):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0.0)


def test_optimizer_wrapper_errors() -> None:
    params = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match=r"implements AdamW, Adam, SGD and Muon; optimizer_fn returned Adagrad"):
        _config(torch.optim.Adagrad(params), 1, "float32")
    with pytest.raises(ValueError, match=r"no amsgrad=True"):
        _config(torch.optim.AdamW(params, amsgrad=True), 1, "float32")
    config = _config(torch.optim.AdamW(params, betas=(0.8, 0.95), eps=1e-6), 2, "float16")
    assert (config.method, config.beta1, config.beta2, config.eps) == ("adamw", 0.8, 0.95, 1e-6)
    assert config.zero_stage == 2 and config.loss_scaler.enable and config.master_weights


def test_plan_optimizer_and_pipeline_constraints() -> None:
    from auto_models import MODELS

    cls, config = MODELS["llama"]
    model = deferred_init(cls, config())
    plan = generate_plan(model, {"zero_stage": 1, "precision": "bfloat16", "data_parallel_size": 2})
    assert (plan.zero_stage, plan.precision) == (1, "bfloat16")
    assert "zero_stage=1, precision=bfloat16" in str(plan)
    with pytest.raises(ValueError, match=r"zero_stage=4 is invalid; choose 0, 1, 2 or 3"):
        generate_plan(model, {"zero_stage": 4})
    with pytest.raises(ValueError, match=r"data_parallel_shard_size=3 must divide data_parallel_size=4"):
        generate_plan(model, {"zero_stage": 3, "data_parallel_size": 4, "data_parallel_shard_size": 3})
    with pytest.raises(ValueError, match=r"data_parallel_shard_size=2 \(HSDP\) needs zero_stage=3 and a shard size"):
        generate_plan(model, {"zero_stage": 1, "data_parallel_size": 4, "data_parallel_shard_size": 2})
    with pytest.raises(ValueError, match=r"cpu_offload='yes' must be true or false"):
        generate_plan(model, {"cpu_offload": "yes"})
    with pytest.raises(ValueError, match=r"precision='fp8' is invalid; choose one of"):
        generate_plan(model, {"precision": "fp8"})
    with pytest.raises(ValueError, match=r"pipeline_parallel.schedule='zb' is invalid"):
        generate_plan(model, {"pipeline_parallel.size": 2, "pipeline_parallel.schedule": "zb"})
    with pytest.raises(ValueError, match=r"num_micro_batches=3 does not divide the per-DP-rank batch"):
        generate_plan(
            model, {"pipeline_parallel.size": 2, "pipeline_parallel.num_micro_batches": 3, "global_batch_size": 4}
        )


def read_worker() -> tuple[float, float]:
    """A ZeRO-3 and a plain dp2 run of the same steps; the embedding's norm read between steps."""
    from auto_models import MODELS, TokenDataset, lr_scheduler_fn, optimizer_fn, plain_loop

    from scaling.trainer.auto import parallelize

    norms = []
    for zero in (3, 0):
        cls, config = MODELS["gpt2"]
        model = deferred_init(cls, config())
        plan = generate_plan(model, {"data_parallel_size": 2, "zero_stage": zero, "global_batch_size": 4, "seed": 7})
        model, optimizer, scheduler, loader = parallelize(plan, model, optimizer_fn, lr_scheduler_fn, TokenDataset())
        plain_loop(model, optimizer, scheduler, loader)
        weight = model.module.transformer.wte.weight
        if zero == 3:  # it segfaulted
            with pytest.raises(RuntimeError, match=r"is sharded by ZeRO-3 .* `with model.full_parameters\(\):`"):
                weight.norm()
        with model.full_parameters():
            norms.append(weight.norm().item())
    return norms[0], norms[1]


def test_a_zero3_weight_reads_inside_full_parameters_and_is_refused_outside() -> None:
    for zero3, plain in run_distributed(read_worker, 2, timeout_seconds=300):
        assert zero3 == pytest.approx(plain, rel=1e-6)


def muon_worker(name: str, layout: dict) -> list[float]:
    return train_worker(name, layout, make_optimizer=muon_fn)


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon arrived in torch 2.9")
@pytest.mark.parametrize(
    "layout",
    [{"tensor_parallel.size": 2}, {"data_parallel_size": 2, "zero_stage": 1}],
    ids=["tp2", "dp2-zero1"],
)
def test_torch_muon_runs_on_whole_matrices_and_matches_one_process(layout: dict) -> None:
    """The user's torch.optim.Muon becomes scaling.optim's Muon under TP (each matrix gathered from its
    TP pieces before Newton-Schulz) and under ZeRO. Newton-Schulz runs in bfloat16 as torch's does, so
    the TP products' fp32 rounding can move a bfloat16 rounding: losses within 3e-4 of one process
    (measured 3.1e-5 at tp2, 1.0e-5 at dp2; torch's Muon on each TP piece: 3.0e-3)."""
    expected = reference_losses("llama", muon_fn)
    world = layout.get("data_parallel_size", 1) * layout.get("tensor_parallel.size", 1)
    for losses in run_distributed(muon_worker, world, "llama", layout, timeout_seconds=420):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=3e-4, atol=0.0)
