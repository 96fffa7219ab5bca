"""Muon in the transformer app (#53): the blocks' matrices by Muon, the embedding, head and vectors
by AdamW; every layout gives the one-process losses (fp32 Newton-Schulz, 1e-5, 10 steps)."""

import pytest
from transformer_testlib import losses, tiny_config, train_worker

from scaling.testing import assert_parity, run_distributed
from scaling.topology import Topology
from scaling.transformer import train
from scaling.transformer.config import TransformerConfig

STEPS = 10
MUON = {"method": "muon", "muon": {"ns_dtype": "float32"}}
MOE = {"moe": {"num_experts": 4, "top_k": 2}}


def _config(corpus, arch=None, **sizes):
    optimizer = {**MUON, **sizes.pop("optimizer", {})}
    cfg = tiny_config(corpus, steps=STEPS, optimizer=optimizer, **sizes)
    cfg["transformer_architecture"].update(arch or {})
    return cfg


def _reference(corpus, arch=None):
    (history,) = run_distributed(train_worker, 1, _config(corpus, arch), timeout_seconds=120)
    out = losses(history)
    assert len(out) == STEPS and out[-1] < out[0]  # it trains
    return out


@pytest.fixture(scope="module")
def reference(tiny_corpus):
    return _reference(tiny_corpus)


def _check(results, expected, what):
    for rank, history in enumerate(results):
        assert_parity(losses(history), expected, rtol=1e-5, name=f"rank {rank} losses at {what}")


def _rules(cfg):
    config = TransformerConfig.from_dict(cfg)
    trainer = train.build_trainer(config, Topology.from_env(config.topology))
    groups = trainer.optimizer.parameter_groups
    return {slot.name: (groups[slot.group_index].name, slot.rule) for slot in trainer.optimizer.slots}


@pytest.mark.distributed
def test_the_blocks_matrices_take_muon_and_the_rest_adamw(tiny_corpus):
    untied = _config(tiny_corpus, {"tied_embeddings": False, "bias": True})
    (rules,) = run_distributed(_rules, 1, untied, timeout_seconds=60)
    muon = {name for name, (_, rule) in rules.items() if rule == "muon"}
    assert muon and all(".attention." in n or ".mlp." in n for n in muon), sorted(muon)
    assert all(rules[n][1] == "adamw" and rules[n][0] == "embedding_head" for n in rules if "embedding" in n)
    assert {rule for n, (group, rule) in rules.items() if group == "no_decay"} == {"adamw"}  # biases, norms
    head = [n for n in rules if n.startswith("layers.3.")]  # the untied head: a matrix, by AdamW
    assert any(rules[n] == ("embedding_head", "adamw") for n in head), {n: rules[n] for n in head}


@pytest.mark.distributed
def test_dp2_zero1_matches_one_process_and_is_not_adamw(tiny_corpus, reference):
    _check(run_distributed(train_worker, 2, _config(tiny_corpus, dp=2, optimizer={"zero_stage": 1})), reference, "dp2")
    (adamw,) = run_distributed(train_worker, 1, tiny_config(tiny_corpus, steps=STEPS), timeout_seconds=120)
    assert losses(adamw)[1:] != pytest.approx(reference[1:], rel=1e-3)  # another update rule


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(
    ("sizes", "world"),
    [
        ({"dp": 2, "tp": 2, "optimizer": {"zero_stage": 3}}, 4),
        ({"dp": 2, "pp": 2, "optimizer": {"zero_stage": 2}}, 4),
    ],
    ids=["dp2-tp2-zero3", "dp2-pp2-zero2"],
)
def test_layouts_match_one_process(tiny_corpus, reference, sizes, world):
    """TP-split matrices are gathered over TP and their ZeRO shards over DP before Newton-Schulz;
    a pipeline stage updates its own blocks; the tied embedding stays with AdamW on both stages."""
    _check(run_distributed(train_worker, world, _config(tiny_corpus, **sizes), timeout_seconds=300), reference, sizes)


@pytest.mark.distributed
@pytest.mark.slow
def test_experts_at_dp2_ep2_match_one_process(tiny_corpus):
    expected = _reference(tiny_corpus, MOE)
    cfg = _config(tiny_corpus, MOE, dp=2, topology={"expert_parallel_size": 2})
    _check(run_distributed(train_worker, 2, cfg, timeout_seconds=300), expected, "dp2-ep2")


@pytest.mark.distributed
@pytest.mark.slow
def test_a_muon_checkpoint_resumes_at_another_layout_on_the_same_curve(tiny_corpus, reference, tmp_path):
    """Five steps at dp2·tp2 with ZeRO-1, saved (momentum buffers as logical tensors); resumed at
    pp2: steps 6-10 are one process's."""
    ckpt = str(tmp_path / "ckpt")
    first = _config(
        tiny_corpus, dp=2, tp=2, optimizer={"zero_stage": 1}, trainer={"save_dir": ckpt, "save_interval": 5}
    )
    first["trainer"]["train_iterations"] = 5
    run_distributed(train_worker, 4, first, timeout_seconds=300)
    second = _config(tiny_corpus, pp=2, trainer={"load_dir": ckpt})
    for rank, history in enumerate(run_distributed(train_worker, 2, second, timeout_seconds=300)):
        assert_parity(losses(history), reference[5:], rtol=1e-5, name=f"rank {rank} resumed at pp2")
