"""Fine-tuning by config: LoRA / BitFit / adapters on a frozen base, and training groups with their own LR."""

import re

import pytest
import torch
from transformer_testlib import losses, tiny_config, train_worker

from scaling.nn import named_parameters_with_meta
from scaling.testing import assert_parity, run_distributed
from scaling.topology import Topology
from scaling.transformer import train
from scaling.transformer.config import FinetuningConfig, TransformerArchitectureConfig, TransformerConfig
from scaling.transformer.finetuning import apply_finetuning, training_groups
from scaling.transformer.generate import generate
from scaling.transformer.inference import TransformerLM


def _changes_worker(cfg):
    """Train ``cfg`` on one rank; return {parameter name: changed?} and the trainable names."""
    config = TransformerConfig.from_dict(cfg)
    topology = Topology.from_env(config.topology)
    trainer = train.build_trainer(config, topology)
    before = {n: p.detach().clone() for n, p in trainer.parallel_module.named_parameters()}
    trainable = sorted(n for n, p in trainer.parallel_module.named_parameters() if p.requires_grad)
    trainer.run_training()
    after = dict(trainer.parallel_module.named_parameters())
    changed = {n: not torch.equal(before[n], after[n].detach()) for n in before}
    topology.destroy()
    return changed, trainable


def _run(corpus, steps=3, arch=None, **sections):
    cfg = tiny_config(corpus, steps=steps, **sections)
    cfg["transformer_architecture"].update(arch or {})
    ((changed, trainable),) = run_distributed(_changes_worker, 1, cfg, timeout_seconds=120)
    return changed, trainable


def _only(changed, predicate):
    moved = sorted(n for n, c in changed.items() if c)
    assert moved, "nothing trained"
    assert all(predicate(n) for n in moved), moved
    return moved


@pytest.mark.distributed
def test_lora_trains_only_the_adapters(tiny_corpus):
    changed, trainable = _run(tiny_corpus, finetuning={"method": "lora", "rank": 4, "target_modules": r"attention\..*"})
    moved = _only(changed, lambda n: ".lora_" in n)
    # Both factors of qkv and dense of both blocks move (B starts at 0, A gets a gradient once B != 0).
    assert {re.sub(r"^layers\.\d+\.", "", n) for n in moved} == {
        f"attention.{m}.lora_{f}.weight" for m in ("qkv", "dense") for f in "AB"
    }
    assert trainable == sorted(n for n in changed if ".lora_" in n)


@pytest.mark.distributed
def test_bitfit_trains_only_biases(tiny_corpus):
    changed, _ = _run(tiny_corpus, arch={"bias": True}, finetuning={"method": "bitfit"})
    moved = _only(changed, lambda n: n.endswith(".bias"))
    assert len(moved) == len([n for n in changed if n.endswith(".bias")])


@pytest.mark.distributed
def test_adapters_train_only_the_adapters(tiny_corpus):
    changed, _ = _run(tiny_corpus, finetuning={"method": "adapter", "adapter_size": 8})
    moved = _only(changed, lambda n: ".adapter." in n)
    assert any(".attention.adapter.up." in n for n in moved) and any(".mlp.adapter.down." in n for n in moved)


@pytest.mark.distributed
def test_training_groups_apply_their_learning_rate(tiny_corpus):
    groups = [
        {"name": "blocks", "include": [r"^layers\.[12]\."], "exclude": [r"norm"], "learning_rate": 0.0},
        {"name": "norms", "include": [r"norm\.weight$"], "learning_rate": 0.01, "weight_decay": 0.0},
    ]
    changed, trainable = _run(tiny_corpus, training={"groups": groups})
    assert _only(changed, lambda n: n.endswith("norm.weight"))  # lr 0 and frozen parameters stay put
    assert "layers.0.embedding.weight" not in trainable  # in no group: frozen
    assert "layers.1.attention.qkv.weight" in trainable and not changed["layers.1.attention.qkv.weight"]


def test_overlapping_groups_name_both_groups_and_the_parameter(tiny_corpus):
    groups = [{"name": "attn", "include": ["attention"]}, {"name": "qkv", "include": ["qkv"]}]
    cfg = TransformerConfig.from_dict(tiny_config(tiny_corpus, training={"groups": groups}))
    params = list(named_parameters_with_meta(TransformerLM(cfg.transformer_architecture)))
    match = r"training.groups: .*'layers.1.attention.qkv.weight' matches groups \['attn', 'qkv'\]"
    with pytest.raises(ValueError, match=match):
        training_groups(params, cfg.training.groups, cfg.learning_rate_scheduler, 0.1)


@pytest.mark.parametrize(
    ("sections", "match"),
    [
        ({"finetuning": {"method": "bitfit"}}, "finetuning.method='bitfit' trains biases only"),
        ({"finetuning": {"method": "lora", "target_modules": "attention.(qkv"}}, "finetuning.target_modules="),
        ({"finetuning": {"method": "sparse"}}, "method"),
        ({"training": {"groups": [{"name": "g", "include": ["(qkv"]}]}}, "training.groups['g'].include: '(qkv'"),
        (
            {
                "finetuning": {"method": "adapter", "adapter_size": 3},
                "topology": {
                    "model_parallel_size": 2,
                    "global_batch_size": 8,
                    "micro_batch_size": 2,
                    "data_parallel_size": 1,
                    "pipe_parallel_size": 1,
                },
            },
            "finetuning.adapter_size=3 is not divisible by topology.model_parallel_size=2",
        ),
    ],
    ids=["bitfit-no-bias", "bad-regex", "bad-method", "bad-group-regex", "adapter-tp"],
)
def test_bad_finetuning_config(tiny_corpus, sections, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        TransformerConfig.from_dict(tiny_config(tiny_corpus, **sections))


def test_lora_target_matching_nothing(tiny_corpus):
    cfg = TransformerConfig.from_dict(tiny_config(tiny_corpus, finetuning={"method": "lora", "target_modules": "q"}))
    model = TransformerLM(cfg.transformer_architecture)
    with pytest.raises(ValueError, match=r"finetuning.target_modules='q' matches no module .*'attention.qkv'"):
        apply_finetuning(list(enumerate(model.layers)), cfg.finetuning)


@pytest.mark.parametrize("method", ["lora", "adapter"])
def test_padded_generation_applies_the_adapters(method):
    arch = TransformerArchitectureConfig(vocab_size=61, hidden_size=32, num_layers=2, num_attention_heads=4)
    model = TransformerLM(arch, seed=2).eval()
    plain = [generate(model, [p], 6)[0] for p in ([3, 9, 4, 1], [7])]
    apply_finetuning(list(enumerate(model.layers)), FinetuningConfig(method=method, adapter_size=8))
    with torch.no_grad():  # adapters start as the identity; give them weight so they matter
        for name, p in model.named_parameters():
            if ".lora_B." in name or ".adapter.up." in name:
                p.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    prompts = [[3, 9, 4, 1], [7]]
    one_by_one = [generate(model, [p], 6)[0] for p in prompts]
    assert generate(model, prompts, 6) == one_by_one and one_by_one != plain


LORA = {"method": "lora", "rank": 4, "alpha": 8.0}


@pytest.fixture(scope="module")
def lora_reference(tiny_corpus):
    (one,) = run_distributed(train_worker, 1, tiny_config(tiny_corpus, steps=4, finetuning=LORA))
    reference = losses(one)
    assert reference[-1] < reference[0]
    return reference


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["tp2-sp", "pp2", "dp2-pp2-zero3", pytest.param("cp2", marks=pytest.mark.slow)])
def test_lora_parallel_layouts_match_one_process(tiny_corpus, lora_reference, layout):
    sizes = {"tp2-sp": {"tp": 2}, "pp2": {"pp": 2}, "dp2-pp2-zero3": {"dp": 2, "pp": 2}, "cp2": {"cp": 2}}[layout]
    cfg = tiny_config(tiny_corpus, steps=4, finetuning=LORA, **sizes)
    cfg["transformer_architecture"]["sequence_parallel"] = layout == "tp2-sp"
    if layout.endswith("zero3"):
        cfg["optimizer"]["zero_stage"] = 3  # the adapters and the frozen base weights are sharded
    world = sizes.get("dp", 1) * sizes.get("tp", 1) * sizes.get("pp", 1) * sizes.get("cp", 1)
    for rank, history in enumerate(run_distributed(train_worker, world, cfg, timeout_seconds=180)):
        assert_parity(losses(history), lora_reference, rtol=1e-5, name=f"rank {rank} LoRA losses at {layout}")


@pytest.mark.distributed
def test_lora_from_a_base_checkpoint_with_zero3_matches_one_process(tiny_corpus, tmp_path):
    # The frozen base weights are sharded under ZeRO-3: the loaded values must reach the shards.
    base = tiny_config(tiny_corpus, steps=3, trainer={"save_dir": str(tmp_path), "save_interval": 3})
    run_distributed(train_worker, 1, base, timeout_seconds=180)
    fresh = {"load_dir": str(tmp_path), "load_optimizer_states": False, "load_context": False}
    runs = {}
    for dp, zero in ((1, 0), (2, 3)):
        cfg = tiny_config(tiny_corpus, dp=dp, steps=4, finetuning=LORA, optimizer={"zero_stage": zero}, trainer=fresh)
        runs[dp] = run_distributed(train_worker, dp, cfg, timeout_seconds=180)
    reference = losses(runs[1][0])
    scratch = losses(run_distributed(train_worker, 1, tiny_config(tiny_corpus, steps=4, finetuning=LORA))[0])
    assert reference[0] < scratch[0]  # it starts from the trained base, not from the initial weights
    for rank, history in enumerate(runs[2]):
        assert_parity(losses(history), reference, rtol=1e-5, name=f"rank {rank} LoRA-from-base losses, ZeRO-3 dp2")


@pytest.mark.slow
@pytest.mark.distributed
def test_lora_on_latent_attention_at_tp2_sp_matches_one_process(tiny_corpus):
    """LoRA on DeepSeek's latent attention (its column- and row-parallel projections) and the MLP: the
    adapters are there, and tp2 with sequence parallelism trains as one process."""
    latent = {"latent_attention": {"kv_lora_rank": 16, "q_lora_rank": 16, "qk_nope_head_dim": 8,
                                   "qk_rope_head_dim": 4, "v_head_dim": 8}, "num_kv_heads": None}  # fmt: skip
    histories = {}
    for tp in (1, 2):
        cfg = tiny_config(tiny_corpus, tp=tp, steps=4, finetuning=LORA)
        cfg["transformer_architecture"].update(latent, sequence_parallel=tp == 2)
        histories[tp] = run_distributed(train_worker, tp, cfg, timeout_seconds=180)
    reference = losses(histories[1][0])
    assert reference[-1] < reference[0]
    for rank, history in enumerate(histories[2]):
        assert_parity(losses(history), reference, rtol=1e-5, name=f"rank {rank} LoRA on latent attention, tp2 sp")
    model = TransformerLM(TransformerArchitectureConfig(**{**tiny_config(tiny_corpus)["transformer_architecture"],
                                                           **latent}))  # fmt: skip
    apply_finetuning(list(enumerate(model.layers)), FinetuningConfig(**LORA))
    adapted = {n.rsplit(".lora_A", 1)[0].split(".", 2)[2] for n, _ in model.named_parameters() if ".lora_A" in n}
    assert {"attention.q_b", "attention.kv_b", "attention.dense"} <= adapted, adapted
