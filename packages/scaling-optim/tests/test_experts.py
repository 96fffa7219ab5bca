"""Expert parallelism in the optimizer: a ParallelMoE trained at ep2 (and ep2 over dp4) equals one process."""

import pytest
import torch

from scaling.nn import MoEConfig, ParallelMoE, attach_parameter_metas
from scaling.optim import MuonConfig, Optimizer, OptimizerConfig, OptimizerParamGroup, OptimizerParamGroupConfig
from scaling.testing import assert_parity, make_topology, run_distributed

H, FFN, E, STEPS, TOKENS = 8, 16, 4, 3, 6


def _train(dp, ep, micro, zero=0, balancing="aux_loss", dtype=torch.float32, **config_extra):
    """``STEPS`` AdamW steps with clipping; returns every parameter and the reported gradient norms.

    In bf16 the experts run as grouped matrix multiplies (forced: on CPU the default loops)."""
    topo = make_topology(data_parallel_size=dp, expert_parallel_size=ep)
    torch.manual_seed(0)
    moe = attach_parameter_metas(
        ParallelMoE(
            MoEConfig(
                H,
                FFN,
                E,
                top_k=2,
                num_shared_experts=1,
                aux_loss_coefficient=0.1,
                balancing=balancing,
                dtype=dtype,
                grouped_gemm=dtype == torch.bfloat16,
            ),
            topology=topo,
        )
    )
    config = OptimizerConfig(**{"method": "adamw", "gradient_clipping": 0.05, "zero_stage": zero, **config_extra})
    named = [(n, p, p.parameter_meta) for n, p in moe.named_parameters() if p.requires_grad]
    group = OptimizerParamGroup(named, OptimizerParamGroupConfig(name="all", weight_decay=0.01))
    optimizer = Optimizer(
        config=config, parameter_groups=[group], topology=topo, zero3_modules=[moe] if zero == 3 else None
    )
    g = torch.Generator().manual_seed(1)
    norms = []
    # One micro-batch per DP rank; one process runs them all, each weighing 1 / micro-batches.
    mine = range(topo.axis("dp").rank * micro // dp, (topo.axis("dp").rank + 1) * micro // dp)
    moe.aux_loss_scale = 1.0 / len(mine)
    for _ in range(STEPS):
        x, target = (torch.randn(micro, 2, TOKENS, H, generator=g).to(dtype) for _ in range(2))
        optimizer.zero_grad()
        moe.load_total = None
        for m in mine:
            optimizer.backward((moe(x[m]) - target[m]).pow(2).mean() / len(mine))
        norms.append(optimizer.step().global_grad_norm)
        with optimizer.data_parallel.whole([moe.expert_bias]):  # as the transformer app's trainer
            moe.end_step()
    with optimizer.full_parameters():
        return {n: p.detach().clone() for n, p in moe.named_parameters()}, norms


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(("dp", "ep", "zero"), [(2, 2, 0), (4, 2, 0), (4, 2, 1), (4, 2, 2), (4, 2, 3), (2, 2, 3)])
def test_expert_parallel_training_matches_one_process(dp, ep, zero):
    """ZeRO shards experts over the ranks holding them (at dp2·ep2 that is one rank: not sharded)."""
    ((expected, expected_norms),) = run_distributed(_train, 1, 1, 1, dp, timeout_seconds=120)
    for params, norms in run_distributed(_train, dp, dp, ep, dp, zero, timeout_seconds=120):
        assert_parity(norms, expected_norms, rtol=1e-5, name="gradient norms")
        assert len([n for n in params if n.startswith("experts.")]) == 3 * E // ep  # this rank's experts only
        for name, value in params.items():
            assert_parity(value, expected[name], rtol=1e-5, atol=1e-7, name=name)


@pytest.mark.distributed
@pytest.mark.slow
def test_aux_loss_free_bias_moves_per_step_as_in_one_process_under_zero0_and_zero3():
    """The aux-loss-free bias is a frozen parameter moved once per step by the step's load over every
    DP rank (``end_step``), so dp4·ep2 (one micro-batch a rank) moves it as one process with four
    micro-batches does; under ZeRO-3 its layer is gathered for the move (``DataParallel.whole``)
    and the change is written back into the shard."""
    ((expected, expected_norms),) = run_distributed(_train, 1, 1, 1, 4, 0, "aux_loss_free", timeout_seconds=120)
    assert expected["expert_bias"].abs().sum() > 0  # the bias moved
    for zero in (0, 3):
        for params, norms in run_distributed(_train, 4, 4, 2, 4, zero, "aux_loss_free", timeout_seconds=120):
            assert_parity(norms, expected_norms, rtol=1e-5, name=f"gradient norms (zero {zero})")
            for name, value in params.items():
                assert_parity(value, expected[name], rtol=1e-5, atol=1e-7, name=f"{name} (zero {zero})")


@pytest.mark.distributed
@pytest.mark.slow
def test_zero3_with_grouped_experts_in_bf16_trains_as_zero0():
    """bf16 grouped experts keep the expert parameters (not a stacked copy) for their backward:
    ZeRO-3 frees them after the forward and gathers them again for the backward, and trains as
    ZeRO 0 at dp4·ep2 (experts sharded over their two ranks). Tolerance: the bf16 gradients are
    summed in another order (reduce-scatter, not all-reduce), one bf16 rounding apart; measured
    1.1e-4 on the norms and 5e-7 on the parameters."""
    plain = run_distributed(_train, 4, 4, 2, 4, 0, "aux_loss", torch.bfloat16, timeout_seconds=120)
    sharded = run_distributed(_train, 4, 4, 2, 4, 3, "aux_loss", torch.bfloat16, timeout_seconds=120)
    for (expected, expected_norms), (params, norms) in zip(plain, sharded, strict=True):
        assert_parity(norms, expected_norms, rtol=1e-3, name="gradient norms")
        for name, value in params.items():
            assert_parity(value, expected[name], rtol=2**-8, atol=1e-6, name=name)


@pytest.mark.distributed
@pytest.mark.parametrize("zero", [0, 3])
def test_muon_over_experts_matches_one_process(zero):
    """Muon at dp2·ep2: each expert's matrices are whole on the rank holding them (ZeRO-3 gathers
    their shards there), the router and the shared expert are gathered over DP; three steps
    equal one process within 1e-5."""
    extra = {"method": "muon", "muon": MuonConfig(ns_dtype="float32")}
    ((expected, expected_norms),) = run_distributed(_train, 1, 1, 1, 2, timeout_seconds=120, **extra)
    for params, norms in run_distributed(_train, 2, 2, 2, 2, zero, timeout_seconds=120, **extra):
        assert_parity(norms, expected_norms, rtol=1e-5, name="gradient norms")
        for name, value in params.items():
            assert_parity(value, expected[name], rtol=1e-5, atol=1e-7, name=name)
