"""Hugging Face interop with a tiny random LlamaForCausalLM (no download)."""

import json

import pytest
import torch

from scaling.transformer.__main__ import main
from scaling.transformer.generate import generate
from scaling.transformer.hf import CHECKPOINT_SUBDIR, export_hf, import_hf
from scaling.transformer.inference import load_model

transformers = pytest.importorskip("transformers")


def _tiny_llama(tmp_path, tie=False):
    config = transformers.LlamaConfig(
        vocab_size=101,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        rope_theta=500.0,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    return model


def _ids():
    return torch.randint(0, 101, (2, 11), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_import_logits_and_export_roundtrip(tmp_path, tie):
    hf_model = _tiny_llama(tmp_path, tie)
    assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "ours")]) == 0
    ours, _ = load_model(tmp_path / "ours" / CHECKPOINT_SUBDIR)
    ids = _ids()
    with torch.no_grad():
        expected = hf_model(ids).logits
        torch.testing.assert_close(ours(ids), expected, rtol=1e-5, atol=1e-5)

    assert main(["export-hf", str(tmp_path / "ours" / CHECKPOINT_SUBDIR), str(tmp_path / "back")]) == 0
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, expected, rtol=1e-5, atol=1e-5)
    prompt = ids[:1, :5]
    hf_tokens = back.generate(prompt, max_new_tokens=10, do_sample=False, pad_token_id=0)[0, 5:].tolist()
    assert generate(ours, [prompt[0].tolist()], 10) == [hf_tokens]


def test_other_architecture_is_refused(tmp_path):
    _tiny_llama(tmp_path)
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg.update(model_type="mistral", architectures=["MistralForCausalLM"])
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ValueError, match=r"model_type='mistral', architectures=\['MistralForCausalLM'\] is not a Llama"
    ):
        import_hf(tmp_path / "hf", tmp_path / "ours")


def test_export_refuses_non_llama_architecture(tmp_path):
    _tiny_llama(tmp_path)
    import_hf(tmp_path / "hf", tmp_path / "ours")
    cfg = (tmp_path / "ours" / "config.yml").read_text().replace("norm: rmsnorm", "norm: layernorm")
    (tmp_path / "gelu.yml").write_text(cfg)
    with pytest.raises(ValueError, match="needs norm='rmsnorm'"):
        export_hf(tmp_path / "ours" / CHECKPOINT_SUBDIR, tmp_path / "back", config_path=tmp_path / "gelu.yml")
