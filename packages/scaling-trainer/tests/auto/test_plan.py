"""deferred_init (no allocation, sharded == sliced) and generate_plan (policy, constraints, errors)."""

from __future__ import annotations

import resource

import pytest
import torch
from auto_models import MODELS
from transformers import LlamaConfig, LlamaForCausalLM

from scaling.trainer.auto import Plan, deferred_init, generate_plan, materialize
from scaling.trainer.auto._tp import make_shard_fn, shard_tensor


def test_deferred_30gb_llama_plans_without_allocating() -> None:
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=64,
        num_attention_heads=32,
        num_key_value_heads=32,
    )
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    model = deferred_init(LlamaForCausalLM, config)
    numel = sum(p.numel() for p in model.parameters())
    assert numel * 4 > 30e9
    plan = generate_plan(
        model,
        {
            "tensor_parallel.size": 8,
            "pipeline_parallel.size": 4,
            "data_parallel_size": 1,
            "pipeline_parallel.split_method": "flops",
        },
    )
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 2 * 1024 * 1024  # < 2 GiB, far below the 30 GB model
    assert plan.split_points == ["model.layers.16", "model.layers.32", "model.layers.48"]


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_materialised_shards_equal_slices_of_one_process_init(name: str) -> None:
    cls, config = MODELS[name]
    full = dict(materialize(deferred_init(cls, config()), seed=5).named_parameters())
    plan = generate_plan(deferred_init(cls, config()), {"tensor_parallel.size": 2})
    for rank in range(2):
        model = deferred_init(cls, config())
        materialize(model, 5, make_shard_fn(model, plan.module_sharding, None, rank, 2))
        for path, param in model.named_parameters():
            sharding = plan.module_sharding.get(path.rpartition(".")[0])
            placement = plan.parameter_sharding[path]
            if placement == "Replicate()":
                torch.testing.assert_close(param, full[path], rtol=0, atol=0)
            else:
                dim = int(placement.split("=")[1][0])
                chunks = sharding.chunks if sharding is not None else 1
                torch.testing.assert_close(param, shard_tensor(full[path], dim, rank, 2, chunks), rtol=0, atol=0)


def test_plan_policy_print_and_yaml(tmp_path) -> None:
    cls, config = MODELS["gpt2"]
    plan = generate_plan(deferred_init(cls, config()), {"tensor_parallel.size": 2, "pipeline_parallel.size": 2})
    assert plan.module_sharding["transformer.h.0.attn.c_attn"].style == "column_fused"
    assert plan.parameter_sharding["transformer.h.0.attn.c_attn.weight"] == "Shard(dim=1)"  # Conv1D [in, out]
    assert plan.parameter_sharding["transformer.h.0.mlp.c_proj.weight"] == "Shard(dim=0)"
    assert plan.parameter_sharding["transformer.wte.weight"] == "Shard(dim=0)"
    assert plan.parameter_sharding["transformer.wpe.weight"] == "Replicate()"
    assert plan.split_points == ["transformer.h.1"]
    assert "pipeline_parallel.split_points : ['transformer.h.1']" in str(plan)
    plan.save(tmp_path / "plan.yaml")
    assert Plan.load(tmp_path / "plan.yaml") == plan
    llama = generate_plan(
        deferred_init(*[f() if i else f for i, f in enumerate(MODELS["llama"])]), {"tensor_parallel.size": 2}
    )
    assert llama.module_sharding["model.layers.0.mlp.down_proj"].style == "row"
    assert llama.module_sharding["model.layers.1.self_attn.k_proj"].style == "column"
    assert llama.module_sharding["lm_head"].style == "vocab_head"


def test_forbidden_split_points_are_honoured() -> None:
    model = deferred_init(
        LlamaForCausalLM,
        LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4),
    )
    plan = generate_plan(
        model,
        {
            "pipeline_parallel.size": 2,
            "pipeline_parallel.split_method": "uniform",
            "pipeline_parallel.forbidden_split_points": ["model.layers.2"],
        },
    )
    assert plan.split_points in (["model.layers.1"], ["model.layers.3"])


def test_impossible_requests_name_the_module() -> None:
    cls, config = MODELS["llama"]
    model = deferred_init(cls, config())
    with pytest.raises(
        ValueError, match=r"tensor_parallel.size=3 does not divide model.layers.0.self_attn.q_proj out_features=32"
    ):
        generate_plan(model, {"tensor_parallel.size": 3})
    with pytest.raises(ValueError, match=r"does not divide the 2 attention heads of model.layers.0.self_attn.k_proj"):
        generate_plan(model, {"tensor_parallel.size": 4})
    with pytest.raises(
        ValueError, match=r"pipeline_parallel.size=3 is more stages than the 2 blocks of 'model.layers'"
    ):
        generate_plan(model, {"pipeline_parallel.size": 3})
    with pytest.raises(ValueError, match=r"no split of 'model.layers' into 2 stages avoids"):
        generate_plan(
            model, {"pipeline_parallel.size": 2, "pipeline_parallel.forbidden_split_points": ["model.layers.1"]}
        )
    with pytest.raises(ValueError, match=r"unknown constraints \['tp'\]"):
        generate_plan(model, {"tp": 2})
    with pytest.raises(ValueError, match=r"split_method='fast' is invalid"):
        generate_plan(model, {"pipeline_parallel.size": 2, "pipeline_parallel.split_method": "fast"})
    with pytest.raises(ValueError, match=r"pipeline_parallel.static_shapes='yes' must be true or false"):
        generate_plan(model, {"pipeline_parallel.size": 2, "pipeline_parallel.static_shapes": "yes"})
    with pytest.raises(
        ValueError, match=r"context_parallel.method='zigzag' is invalid; choose one of \['ring', 'all_to_all'\]"
    ):
        generate_plan(model, {"context_parallel.size": 2, "context_parallel.method": "zigzag"})
    with pytest.raises(
        ValueError, match=r"needs the 2 query heads of each tensor-parallel rank to divide by context_parallel_size=4"
    ):
        generate_plan(
            model, {"tensor_parallel.size": 2, "context_parallel.size": 4, "context_parallel.method": "all_to_all"}
        )
    with pytest.raises(ValueError, match=r"context_parallel.size=2 needs a transformers model .*Linear is not one"):
        generate_plan(torch.nn.Linear(4, 4), {"context_parallel.size": 2})
    cp = generate_plan(model, {"context_parallel.size": 2, "data_parallel_size": 2, "global_batch_size": 4})
    assert (cp.world_size, cp.context_parallel_method) == (4, "ring")
    assert "cp=2 (world_size=4)" in str(cp) and Plan.from_dict(cp.to_dict()) == cp
    # The RFC's order (constraints first) gives the same plan.
    rfc = generate_plan({"tensor_parallel.size": 2}, model)  # type: ignore[arg-type]
    assert rfc.to_dict() == generate_plan(model, {"tensor_parallel.size": 2}).to_dict()
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got dict"):
        generate_plan({"tensor_parallel.size": 2}, {"tp": 1})  # type: ignore[arg-type]
