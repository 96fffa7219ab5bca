"""Named architectures: the published shapes count what transformers' own models count, a preset
composes with fields beside it, and the small ones train."""

import pytest
import torch
from transformer_testlib import TINY_VOCAB, losses, tiny_config, train_worker

from scaling.testing import run_distributed
from scaling.transformer.__main__ import main
from scaling.transformer.config import TransformerArchitectureConfig, TransformerConfig
from scaling.transformer.hf import _hf_config, family_of
from scaling.transformer.presets import PRESETS

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_parameter_counts_are_transformers_models_of_the_exported_config(name):
    """The preset's parameters and active parameters equal those of the transformers model its
    export's config.json builds (on the meta device: no memory), e.g. Llama 3 8B 8,030,261,248."""
    arch = TransformerArchitectureConfig(preset=name)
    fields = _hf_config(arch, family_of(arch))
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert type(model).__name__ == fields["architectures"][0]
    total = sum(p.numel() for p in model.parameters())
    assert arch.num_parameters() == total
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    moe = arch.moe
    idle = 0 if moe is None else experts * (moe.num_experts - moe.top_k) // moe.num_experts
    assert arch.num_parameters(active=True) == total - idle


def test_fields_beside_a_preset_replace_its_and_an_unknown_one_is_named():
    arch = TransformerArchitectureConfig(preset="qwen3_0.6b", num_layers=2)
    assert (arch.num_layers, arch.hidden_size, arch.head_dim, arch.qk_norm) == (2, 1024, 128, True)
    # The saved config (every field explicit, the preset named) validates to the same architecture.
    assert TransformerArchitectureConfig.model_validate(arch.as_dict()) == arch
    with pytest.raises(
        ValueError, match=r"preset='gpt5' is not a preset; choose one of \['deepseek_v3_671b', 'llama3.1_8b'"
    ):
        TransformerArchitectureConfig(preset="gpt5")
    with pytest.raises(ValueError, match="transformer_architecture.preset"):
        TransformerConfig.from_dict({"transformer_architecture": {"preset": "llama9"}})


def test_the_readme_override_replaces_the_bundled_section():
    from scaling.transformer.__main__ import DEFAULT_CONFIG

    config = TransformerConfig.from_file(DEFAULT_CONFIG, ["transformer_architecture={preset: tiny_llama3}"])
    assert config.transformer_architecture == TransformerArchitectureConfig(preset="tiny_llama3")


def test_presets_command_lists_every_preset(capsys):
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    assert "llama3_8b        LlamaForCausalLM         32   4096   8,030,261,248   8,030,261,248" in out
    assert all(name in out for name in PRESETS)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_small_preset_trains_at_dp2_ep2(tiny_corpus):
    cfg = tiny_config(tiny_corpus, dp=2, steps=6, topology={"expert_parallel_size": 2})
    cfg["transformer_architecture"] = {"preset": "tiny_qwen3_moe", "vocab_size": TINY_VOCAB, "hidden_size": 64,
                                       "num_layers": 2, "max_sequence_length": 64}  # fmt: skip
    history = run_distributed(train_worker, 2, cfg, timeout_seconds=180)[0]
    out = losses(history)
    assert len(out) == 6 and out[-1] < out[0]
