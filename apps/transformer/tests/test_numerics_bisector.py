"""The numerics bisector (``scaling.trainer.numerics``) on the transformer app: each injected bug
is named at the right module, in the right quantity, on step 1; each correct layout passes.

A mutation is applied inside the workers for the parallel run only (the reference is one
process) and undone afterwards (the pooled workers run other tests next).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from transformer_testlib import losses, tiny_config, train_worker

from scaling.testing import assert_parity, run_distributed
from scaling.topology import Topology
from scaling.trainer.numerics import NumericsReport, Trace, compare
from scaling.transformer.config import TransformerConfig
from scaling.transformer.train import build_trainer

STEPS = 2
MOE = {"moe": {"every": 2, "num_experts": 4, "top_k": 2, "num_shared_experts": 1}}
AUX_FREE = {"moe": {"every": 2, "num_experts": 4, "top_k": 2, "balancing": "aux_loss_free", "bias_update_rate": 0.01}}


@contextlib.contextmanager
def _patched(owner: object, name: str, value: object) -> Iterator[None]:
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


def _mutation(name: str | None) -> contextlib.AbstractContextManager[None]:
    """The bug ``name`` injected into this process (nothing for None)."""
    if name is None:
        return contextlib.nullcontext()
    if name == "tp_backward_all_reduce_dropped":  # the column-parallel input's gradient left partial
        import scaling.nn._linear as linear

        return _patched(linear, "copy_to_model_parallel_region", lambda x, group: x)
    if name == "padded_vocabulary_in_the_loss":  # the padding columns join the softmax (Megatron-LM 1736)
        import scaling.transformer.model as model

        real = model.vocab_parallel_cross_entropy
        return _patched(model, "vocab_parallel_cross_entropy", lambda *a, **k: real(*a, **{**k, "vocab_size": None}))
    from scaling.optim._spaces import ShardSpace

    if name in ("expert_gradients_doubled", "expert_gradient_reduction_missing"):
        real_finish, real_start = ShardSpace.finish_reduction, ShardSpace.start_reduction

        def doubled(self: ShardSpace) -> None:
            real_finish(self)
            if self.kind == "expert":
                for slot in self.slots:
                    grad = slot.grad_shard if slot.grad_shard is not None else slot.param.grad
                    if grad is not None:
                        grad.mul_(2)

        def without_experts(self: ShardSpace, *args: Any) -> None:
            if self.kind != "expert":
                real_start(self, *args)

        if name == "expert_gradients_doubled":
            return _patched(ShardSpace, "finish_reduction", doubled)
        return _patched(ShardSpace, "start_reduction", without_experts)
    if name == "stale_float8_all_gather_scale":  # the gathered float8 weight keeps its first inverse scale (1)
        import scaling.optim._zero3 as zero3

        def fill_without_scale(slot: Any, data: torch.Tensor, inverse: torch.Tensor) -> None:
            held = slot.float8_weight
            if held.tensor.untyped_storage().nbytes() != slot.numel:
                held.tensor.untyped_storage().resize_(slot.numel)
            held.tensor.data.view(-1).copy_(data)

        return _patched(zero3, "fill_float8", fill_without_scale)
    if name == "expert_bias_times_tp":  # the aux-loss-free bias moved once per TP rank (torchtitan 4245)
        from scaling.nn import ParallelMoE

        real_end = ParallelMoE.end_step

        def end_step(self: ParallelMoE) -> None:
            before = self.expert_bias.detach().clone()
            real_end(self)
            with torch.no_grad():
                self.expert_bias.copy_(before + (self.expert_bias - before) * self._tp.size)

        return _patched(ParallelMoE, "end_step", end_step)
    raise ValueError(f"unknown mutation {name!r}")


def record_worker(cfg: dict[str, Any], mutation: str | None = None) -> Trace | None:
    config = TransformerConfig.from_dict(cfg)
    topology = Topology.from_env(config.topology)
    try:
        with _mutation(mutation):
            from scaling.trainer.numerics import NumericsRecorder

            return NumericsRecorder(build_trainer(config, topology)).run(STEPS)
    finally:
        topology.destroy()


def _bisect(corpus: Path, arch: dict[str, Any], world: int, mutation: str | None, **sizes: Any) -> NumericsReport:
    reference = tiny_config(corpus, steps=STEPS, **({"training": FLOAT8_TRAINING} if arch is FLOAT8 else {}))
    reference["transformer_architecture"].update(arch)
    parallel = tiny_config(corpus, steps=STEPS, **sizes)
    parallel["transformer_architecture"].update(arch)
    a = run_distributed(record_worker, 1, reference, timeout_seconds=120)[0]
    b = run_distributed(record_worker, world, parallel, mutation, timeout_seconds=120)[0]
    assert a is not None and b is not None
    return compare(a, b)


# Float8 products in the blocks (sizes multiples of 16); ZeRO-3 gathers their weights in float8.
FLOAT8 = {"intermediate_size": 64}
FLOAT8_TRAINING = {"fp8": {"enabled": True, "min_features": 16, "scaling": "tensorwise"}}
ZERO3_FLOAT8 = {
    "dp": 2,
    "optimizer": {"zero_stage": 3},
    "training": {"fp8": {**FLOAT8_TRAINING["fp8"], "all_gather": True}},
}
TP2 = {"tp": 2}
EP2 = {"dp": 2, "topology": {"expert_parallel_size": 2}}
EDP2 = {"dp": 4, "topology": {"expert_parallel_size": 2}}


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("arch", "world", "sizes"),
    [
        ({}, 2, TP2),
        pytest.param({"vocab_size": 301}, 2, TP2, marks=pytest.mark.slow),
        (MOE, 2, EP2),
        pytest.param(MOE, 4, EDP2, marks=pytest.mark.slow),
        pytest.param(AUX_FREE, 2, TP2, marks=pytest.mark.slow),
        (FLOAT8, 2, ZERO3_FLOAT8),
        # the parity tests' layouts, module by module (test_parity.py compares their losses and norms)
        ({}, 2, {"pp": 2}),
        pytest.param({}, 2, {"dp": 2, "optimizer": {"zero_stage": 1}}, marks=pytest.mark.slow),
        pytest.param({"sequence_parallel": True}, 2, TP2, marks=pytest.mark.slow),
        pytest.param({}, 2, {"cp": 2}, marks=pytest.mark.slow),
        pytest.param({}, 4, {"dp": 2, "tp": 2, "optimizer": {"zero_stage": 3}}, marks=pytest.mark.slow),
        pytest.param({}, 8, {"dp": 2, "tp": 2, "pp": 2, "optimizer": {"zero_stage": 1}}, marks=pytest.mark.slow),
    ],
    ids=[
        "tp2",
        "tp2-vocab301",
        "dp2-ep2",
        "dp4-ep2",
        "aux-free-tp2",
        "float8-zero3-dp2",
        "pp2-tied",
        "dp2-zero1",
        "tp2-sp",
        "cp2",
        "dp2-tp2-zero3",
        "dp2-tp2-pp2",
    ],
)
def test_a_correct_layout_passes(tiny_corpus, arch, world, sizes):
    report = _bisect(tiny_corpus, arch, world, None, **sizes)
    assert report.first is None, report.describe()
    assert report.compared > 100 and not report.only_in_one, report.describe()
    assert set(report.worst) == {"output", "input gradient", "gradient", "update"}, report.describe()


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("mutation", "arch", "world", "sizes", "quantity", "names"),
    [
        (
            "tp_backward_all_reduce_dropped",
            {},
            2,
            TP2,
            "input gradient",
            ("layers.2.mlp.gate_proj", "layers.2.mlp.up_proj"),
        ),
        pytest.param(
            "padded_vocabulary_in_the_loss", {"vocab_size": 301}, 2, TP2, "output", ("loss",), marks=pytest.mark.slow
        ),
        ("expert_gradients_doubled", MOE, 2, EP2, "gradient", tuple(f"layers.2.mlp.experts.{e}." for e in range(4))),
        pytest.param(
            "expert_gradient_reduction_missing",
            MOE,
            4,
            EDP2,
            "gradient",
            tuple(f"layers.2.mlp.experts.{e}." for e in range(4)),
            marks=pytest.mark.slow,
        ),
        ("expert_bias_times_tp", AUX_FREE, 2, TP2, "update", ("layers.2.mlp.expert_bias",)),
        ("stale_float8_all_gather_scale", FLOAT8, 2, ZERO3_FLOAT8, "output", ("layers.1.attention.qkv",)),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_an_injected_bug_is_named_at_its_module_on_step_1(tiny_corpus, mutation, arch, world, sizes, quantity, names):
    report = _bisect(tiny_corpus, arch, world, mutation, **sizes)
    first = report.first
    assert first is not None, f"{mutation} went unnoticed:\n{report.describe()}"
    assert (first.step, first.quantity) == (1, quantity), report.describe()
    assert first.name.startswith(names), report.describe()


def mutated_train_worker(cfg: dict[str, Any], mutation: str) -> list[dict[str, Any]]:
    with _mutation(mutation):
        return train_worker(cfg)


@pytest.mark.distributed
@pytest.mark.slow
def test_doubled_expert_gradients_pass_a_loss_only_check_and_fail_the_gradient_norms(tiny_corpus):
    """Adam's update does not change when every expert gradient doubles, so 10 steps of losses stay
    within the parity tests' 1e-5; the global gradient norm, which they compare now, does not."""
    reference = tiny_config(tiny_corpus, steps=10)
    reference["transformer_architecture"].update(MOE)
    parallel = tiny_config(tiny_corpus, steps=10, **EP2)
    parallel["transformer_architecture"].update(MOE)
    (expected,) = run_distributed(train_worker, 1, reference, timeout_seconds=120)
    got = run_distributed(mutated_train_worker, 2, parallel, "expert_gradients_doubled", timeout_seconds=120)[0]
    assert_parity(losses(got), losses(expected), rtol=1e-5, name="losses")
    norm = "training/global_grad_norm"
    with pytest.raises(AssertionError, match=r"gradient norms\[0\]: not within rtol=0.0001"):
        assert_parity(losses(got, norm), losses(expected, norm), rtol=1e-4, name="gradient norms")


def test_the_command_runs_the_app_s_launch_checks_before_starting_a_side(tiny_corpus, tmp_path, capsys):
    """A side the app would refuse (float8 on sizes that are not multiples of 16) is refused with the
    app's message and status 2 before any process starts."""
    from scaling.trainer.numerics._cli import main

    path = tmp_path / "tiny.yml"
    path.write_text(yaml.safe_dump(tiny_config(tiny_corpus, steps=STEPS)))
    b = ["training.fp8.enabled=true", "training.fp8.min_features=16"]
    assert main(["numerics", "transformer", str(path), "--b", *b]) == 2
    captured = capsys.readouterr()
    assert "scaling-check: invalid app or config: training.fp8: layer" in captured.err, captured.err
    assert "multiples of 16" in captured.err and "scaling-check: side" not in captured.out
