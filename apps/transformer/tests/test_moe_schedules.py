"""MoE balancing under every pipeline schedule and accumulation (#53): the auxiliary losses (the
Switch loss per micro-batch and DeepSeek-V3's sequence-wise one) and the router's gradients equal
one process's for the same micro-batches.

The peers' losses break here (torchtitan's sequence-wise aux loss "works well only with 1F1B",
PR 2061; its batch-wise one errors with accumulation or PP, PR 3000). Two blocks, the first dense
and the second MoE (4 experts, top-2, both losses), so a pipeline stage holds no MoE
layer: at pp2 stage 0 holds the embedding and the dense block; interleaved (two chunks of one
layer each) stage 1 holds the dense block and the head. SGD without momentum, so the router's
change over the steps is the learning rates times the sum of its gradients: equal changes are
equal gradients (an Adam step would hide them behind ``g / |g|``).
"""

import pytest
from transformer_testlib import tiny_config

from scaling.testing import assert_parity, run_distributed
from scaling.topology import Topology
from scaling.transformer import train
from scaling.transformer.config import TransformerConfig

STEPS = 3
SCHEDULES = {
    "gpipe": {"schedule": "gpipe"},
    "1f1b": {"schedule": "1f1b"},
    "zb_h1": {"schedule": "zb_h1"},
    "interleaved": {"schedule": "interleaved_1f1b", "num_virtual_stages": 2},
    "zb_v": {"schedule": "zb_v"},
}
# Both losses: the Switch one per micro-batch and DeepSeek-V3's sequence-wise one.
MOE = {"first_dense_layers": 1, "num_experts": 4, "top_k": 2, "aux_loss_coefficient": 0.1,
       "sequence_aux_loss_coefficient": 0.05}  # fmt: skip


def _config(corpus, micro, dp=1, pp=1, ep=1, cp=1, training=None, moe=None):
    cfg = tiny_config(
        corpus, dp=dp, pp=pp, cp=cp, steps=STEPS, topology={"expert_parallel_size": ep, "micro_batch_size": micro},
        training=training or {}, optimizer={"method": "sgd"},
    )  # fmt: skip
    cfg["trainer"]["log_interval"] = 1
    cfg["transformer_architecture"]["moe"] = {**MOE, **(moe or {})}
    return cfg


def _worker(cfg):
    """The run's history and the router's change over it, on the rank(s) holding the MoE block."""
    config = TransformerConfig.from_dict(cfg)
    topology = Topology.from_env(config.topology)
    trainer = train.build_trainer(config, topology)
    routers = {n: p for n, p in trainer.parallel_module.named_parameters() if n.endswith(".router")}
    before = {n: p.detach().clone() for n, p in routers.items()}
    history = trainer.run_training(return_metrics=True) or []
    moved = {n: p.detach() - before[n] for n, p in routers.items()}
    topology.destroy()
    return history, moved


def _compare(results, reference, what, pipelined=False):
    ((expected, expected_moved),) = reference
    if pipelined:  # a stage without the MoE block takes part all the same
        assert any(not moved for _, moved in results), f"{what}: every stage holds an MoE block"
    seen = set()
    for rank, (history, moved) in enumerate(results):
        for step, (got, want) in enumerate(zip(history, expected, strict=True), 1):
            for key in ("training/loss", "moe/aux_loss"):
                assert_parity(got[key], want[key], rtol=1e-6, name=f"{what} rank {rank} step {step} {key}")
        for name, delta in moved.items():
            assert_parity(delta, expected_moved[name], rtol=1e-5, atol=1e-9, name=f"{what} rank {rank} {name}")
            seen.add(name)
    assert seen == set(expected_moved), f"{what}: no rank reported the router(s) {set(expected_moved) - seen}"


@pytest.fixture(scope="module")
def references(tiny_corpus):
    """One process, the global batch of 8 as micro-batches of 4 (2 per step) and of 1 (8 per step)."""
    out = {micro: run_distributed(_worker, 1, _config(tiny_corpus, micro), timeout_seconds=120) for micro in (4, 1)}
    for ((history, moved),) in out.values():
        assert all(m["moe/aux_loss"] > 0 for m in history) and any(d.abs().sum() > 0 for d in moved.values())
    return out


@pytest.mark.distributed
def test_dp2_ep2(tiny_corpus, references):
    """dp2·ep2: each rank runs 8 / (2 · micro) micro-batches (1 or 4) and holds 2 of the 4 experts."""
    for micro in (4, 1):
        cfg = _config(tiny_corpus, micro, dp=2, ep=2)
        _compare(run_distributed(_worker, 2, cfg, timeout_seconds=180), references[micro], f"dp2-ep2 micro {micro}")


@pytest.mark.distributed
@pytest.mark.slow
def test_every_schedule_at_pp2_dp2_ep2_and_pp2_and_cp2(tiny_corpus, references):
    """pp2·dp2·ep2 on 4 ranks under each schedule with 1 or 4 micro-batches per rank and step; pp2
    alone (ep1) under each schedule with 8 micro-batches of one sequence; cp2·dp2·ep2, where each
    sequence is split over two ranks and both losses take its counts and probabilities summed over
    them. One test, so that the one-process references run once."""
    for schedule, training in SCHEDULES.items():
        for micro in (4, 1):
            cfg = _config(tiny_corpus, micro, dp=2, pp=2, ep=2, training=training)
            results = run_distributed(_worker, 4, cfg, timeout_seconds=300)
            _compare(results, references[micro], f"pp2-dp2-ep2 {schedule} micro {micro}", pipelined=True)
        cfg = _config(tiny_corpus, 1, pp=2, training=training)
        results = run_distributed(_worker, 2, cfg, timeout_seconds=300)
        _compare(results, references[1], f"pp2 {schedule}", pipelined=True)
    cfg = _config(tiny_corpus, 4, dp=2, cp=2, ep=2)
    _compare(run_distributed(_worker, 4, cfg, timeout_seconds=300), references[4], "cp2-dp2-ep2")


GLOBAL = {"global_aux_loss": True}


@pytest.mark.distributed
def test_global_aux_loss_at_dp2_is_one_process_at_twice_the_micro_batch(tiny_corpus):
    """``moe.global_aux_loss``: the Switch loss over the same micro-batch of both DP ranks, so dp2·ep2
    with one micro-batch of 4 sequences per rank equals one process with one of 8 (the sequence-wise
    loss is per sequence either way). With more micro-batches a rank's j-th holds other sequences
    than one process's j-th (each rank reads its own quarter of the batch), so the slow test below
    takes dp2·ep2 without a pipeline as the reference of the schedules."""
    reference = run_distributed(_worker, 1, _config(tiny_corpus, 8, moe=GLOBAL), timeout_seconds=120)
    cfg = _config(tiny_corpus, 4, dp=2, ep=2, moe=GLOBAL)
    _compare(run_distributed(_worker, 2, cfg, timeout_seconds=180), reference, "global dp2-ep2")


@pytest.mark.distributed
@pytest.mark.slow
def test_global_aux_loss_under_every_schedule(tiny_corpus):
    """pp2·dp2·ep2 with 4 micro-batches per rank under every schedule equals dp2·ep2 without a pipeline."""
    reference = run_distributed(_worker, 2, _config(tiny_corpus, 1, dp=2, ep=2, moe=GLOBAL), timeout_seconds=180)
    for schedule, training in SCHEDULES.items():
        cfg = _config(tiny_corpus, 1, dp=2, pp=2, ep=2, training=training, moe=GLOBAL)
        results = run_distributed(_worker, 4, cfg, timeout_seconds=300)
        _compare(results, reference[:1], f"global pp2-dp2-ep2 {schedule}", pipelined=True)
