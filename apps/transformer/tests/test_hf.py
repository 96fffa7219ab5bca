"""Hugging Face interop with tiny random models of every family import-hf reads (no download)."""

import json
import re
from pathlib import Path

import pytest
import torch
import yaml
from transformer_testlib import TINY_VOCAB, logits_worker, tiny_config, train_worker

from scaling.testing import run_distributed
from scaling.transformer.__main__ import main
from scaling.transformer.generate import generate
from scaling.transformer.hf import CHECKPOINT_SUBDIR, export_hf, export_peft, import_hf
from scaling.transformer.inference import load_model

transformers = pytest.importorskip("transformers")


# The tiny shape both architectures share.
TINY = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    rope_theta=500.0,
)


def _saved(tmp_path, model_cls, config):
    """A random ``model_cls(config)`` (seed 0), saved to ``tmp_path / "hf"``. DeepSeek's router
    correction bias starts at zero: random values here test where it goes."""
    torch.manual_seed(0)
    model = model_cls(config).eval()
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.normal_(0, 0.05)
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    return model


def _tiny_llama(tmp_path, tie=False, vocab_size=101):
    config = transformers.LlamaConfig(vocab_size=vocab_size, tie_word_embeddings=tie, **TINY)
    return _saved(tmp_path, transformers.LlamaForCausalLM, config)


def _ids():
    return torch.randint(0, 101, (2, 11), generator=torch.Generator().manual_seed(1))


def _roundtrip(tmp_path, hf_model):
    """Import ``hf_model``'s folder, compare logits; export, reload with transformers, compare logits
    and greedy tokens. Returns our model's config."""
    assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "ours")]) == 0
    ours, config = load_model(tmp_path / "ours" / CHECKPOINT_SUBDIR)
    ids = _ids()
    with torch.no_grad():
        expected = hf_model(ids).logits
        torch.testing.assert_close(ours(ids), expected, rtol=1e-5, atol=1e-5)

    assert main(["export-hf", str(tmp_path / "ours" / CHECKPOINT_SUBDIR), str(tmp_path / "back")]) == 0
    back = type(hf_model).from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, expected, rtol=1e-5, atol=1e-5)
    prompt = ids[:1, :5]
    hf_tokens = back.generate(prompt, max_new_tokens=10, do_sample=False, pad_token_id=0)[0, 5:].tolist()
    assert generate(ours, [prompt[0].tolist()], 10) == [hf_tokens]
    return config


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_import_logits_and_export_roundtrip(tmp_path, tie):
    _roundtrip(tmp_path, _tiny_llama(tmp_path, tie))


def test_other_architecture_is_refused(tmp_path):
    _tiny_llama(tmp_path)
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg.update(model_type="mistral", architectures=["MistralForCausalLM"])
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ValueError, match=r"model_type='mistral', architectures=\['MistralForCausalLM'\] is not a checkpoint import"
    ):
        import_hf(tmp_path / "hf", tmp_path / "ours")


def test_export_refuses_non_llama_architecture(tmp_path):
    _tiny_llama(tmp_path)
    import_hf(tmp_path / "hf", tmp_path / "ours")
    cfg = (tmp_path / "ours" / "config.yml").read_text().replace("norm: rmsnorm", "norm: layernorm")
    (tmp_path / "gelu.yml").write_text(cfg)
    with pytest.raises(ValueError, match="needs norm='rmsnorm'"):
        export_hf(tmp_path / "ours" / CHECKPOINT_SUBDIR, tmp_path / "back", config_path=tmp_path / "gelu.yml")


@pytest.mark.distributed
def test_lora_finetune_of_an_hf_model_loads_with_peft_on_it(tiny_corpus, tmp_path):
    """import-hf, LoRA fine-tune from that checkpoint, export the adapter: peft.PeftModel on the original
    HF model gives our logits (fp32, 1e-5)."""
    peft = pytest.importorskip("peft")
    hf_model = _tiny_llama(tmp_path, vocab_size=TINY_VOCAB)
    assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "ours")]) == 0
    save = tmp_path / "lora"
    cfg = tiny_config(
        tiny_corpus,
        steps=4,
        trainer={"save_dir": str(save), "save_interval": 4, "load_dir": str(tmp_path / "ours" / CHECKPOINT_SUBDIR),
                 "load_optimizer_states": False, "load_context": False},
        finetuning={"method": "lora", "rank": 4, "alpha": 8.0},
    )  # fmt: skip
    cfg["transformer_architecture"] = yaml.safe_load((tmp_path / "ours" / "config.yml").read_text())[
        "transformer_architecture"
    ]
    run_distributed(train_worker, 1, cfg, timeout_seconds=120)
    assert main(["export-hf", str(save), str(tmp_path / "base"), "--peft-dir", str(tmp_path / "adapter")]) == 0
    ours, _ = load_model(save)
    ids = torch.randint(0, TINY_VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base_logits = hf_model(ids).logits
        exported = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "base").eval()
        torch.testing.assert_close(exported(ids).logits, base_logits, rtol=1e-5, atol=1e-5)  # base untouched
        peft_model = peft.PeftModel.from_pretrained(hf_model, str(tmp_path / "adapter")).eval()
        expected = ours(ids)
        # The adapter matters (B != 0 after training), and PEFT on the original model reproduces it.
        assert (expected - base_logits).abs().max() > 1e-4
        torch.testing.assert_close(peft_model(ids).logits, expected, rtol=1e-5, atol=1e-5)


def test_peft_export_needs_a_lora_checkpoint(tmp_path):
    _tiny_llama(tmp_path)
    import_hf(tmp_path / "hf", tmp_path / "ours")
    with pytest.raises(ValueError, match="finetuning.method='none' in the checkpoint's config; a PEFT adapter needs"):
        export_peft(tmp_path / "ours" / CHECKPOINT_SUBDIR, tmp_path / "adapter")


def test_export_of_a_tampered_checkpoint_is_one_line_naming_the_file(tmp_path, capsys):
    _tiny_llama(tmp_path)
    import_hf(tmp_path / "hf", tmp_path / "ours")
    step = next((tmp_path / "ours" / CHECKPOINT_SUBDIR).glob("step_*"))
    shard = next(step.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["export-hf", str(tmp_path / "ours" / CHECKPOINT_SUBDIR), str(tmp_path / "back")]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("scaling-transformer export-hf: CheckpointError: ")
    assert f"{shard}: sha256 differs from commit.json" in err


def _tiny_mixtral(tmp_path):
    config = transformers.MixtralConfig(vocab_size=101, num_local_experts=4, num_experts_per_tok=2, **TINY)
    return _saved(tmp_path, transformers.MixtralForCausalLM, config)


def test_mixtral_import_logits_and_export_roundtrip(tmp_path):
    moe = _roundtrip(tmp_path, _tiny_mixtral(tmp_path)).transformer_architecture.moe
    assert (moe.num_experts, moe.top_k, moe.every, moe.ffn_size) == (4, 2, 1, 48)


# Llama 3.1's RoPE scaling with a pretraining context short enough that every frequency of the
# tiny heads is scaled or blended (wavelengths 6.3 to 664 against band edges 4 and 16).
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}  # fmt: skip


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
DEEPSEEK = dict(kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, n_routed_experts=8,
                num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1, n_shared_experts=1,
                moe_intermediate_size=24, num_key_value_heads=4)  # fmt: skip


def _family(name, vocab_size=101):
    """(model class, config) of a tiny random model of each family the app reads (transformers writes
    rope_theta into the rope_scaling dict it is given: each config gets its own copy)."""
    t = transformers
    tiny = {**TINY, "vocab_size": vocab_size}
    return {
        "llama3.1": (t.LlamaForCausalLM, lambda: t.LlamaConfig(**tiny, rope_scaling=dict(LLAMA3_ROPE))),
        "llama3.2": (t.LlamaForCausalLM, lambda: t.LlamaConfig(**tiny, rope_scaling=dict(LLAMA3_ROPE), tie_word_embeddings=True)),
        "qwen2.5": (t.Qwen2ForCausalLM, lambda: t.Qwen2Config(**tiny, tie_word_embeddings=True)),
        # Qwen3 sets the head size apart from the width (heads x head_dim = 64 > hidden 32).
        "qwen3": (t.Qwen3ForCausalLM, lambda: t.Qwen3Config(**tiny, head_dim=16)),
        "qwen3-moe": (t.Qwen3MoeForCausalLM, lambda: t.Qwen3MoeConfig(
            **tiny, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=True)),
        # Multi-head latent attention, a dense first block, 8 experts in 4 groups (2 open), a shared expert.
        "deepseek-v3": (t.DeepseekV3ForCausalLM, lambda: t.DeepseekV3Config(**{**tiny, **DEEPSEEK}, q_lora_rank=16)),
        "deepseek-v3-no-q-latent": (t.DeepseekV3ForCausalLM, lambda: t.DeepseekV3Config(**{**tiny, **DEEPSEEK}, q_lora_rank=None)),
        # YaRN: DeepSeek's with its softmax correction (mscale_all_dim), Qwen3's with the cos/sin factor.
        "deepseek-v3-yarn": (t.DeepseekV3ForCausalLM, lambda: t.DeepseekV3Config(
            **{**tiny, **DEEPSEEK}, q_lora_rank=16, rope_scaling={**YARN, "mscale": 1.0, "mscale_all_dim": 0.707})),
        "qwen3-yarn": (t.Qwen3ForCausalLM, lambda: t.Qwen3Config(**tiny, head_dim=16, rope_scaling=dict(YARN))),
        # Block 0 dense (decoder_sparse_step 2), top-k scores not renormalised.
        "qwen3-moe-sparse-step": (t.Qwen3MoeForCausalLM, lambda: t.Qwen3MoeConfig(
            **tiny, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, decoder_sparse_step=2)),
    }[name]  # fmt: skip


FAMILIES = [
    "llama3.1",
    "llama3.2",
    "qwen2.5",
    "qwen3",
    "qwen3-moe",
    "qwen3-moe-sparse-step",
    "deepseek-v3",
    "deepseek-v3-no-q-latent",
    "deepseek-v3-yarn",
    "qwen3-yarn",
]


@pytest.mark.parametrize("family", FAMILIES)
def test_family_import_logits_export_roundtrip_and_tensors_bitwise(tmp_path, family):
    """HF -> ours: logits within 1e-5 of transformers; ours -> HF: from_pretrained's logits and greedy
    tokens equal, and every tensor bitwise what the original folder held."""
    from safetensors.torch import load_file

    model_cls, config = _family(family)
    arch = _roundtrip(tmp_path, _saved(tmp_path, model_cls, config())).transformer_architecture
    before, after = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(before) == sorted(after)
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name
    # The parameter count the planner and MFU use is the model's (the MoE's frozen routing bias aside).
    ours, _ = load_model(tmp_path / "ours" / CHECKPOINT_SUBDIR)
    assert arch.num_parameters() == sum(p.numel() for p in ours.parameters() if p.requires_grad)


# Published RoPE scalings: (transformers config, the channels rotated, our RopeScaling).
ROPE_CASES = {
    # Llama 3.1 8B: theta 5e5, 128 channels per head, the 8k context stretched 8x to 128k.
    "llama3.1": (dict(head_dim=128, max_position_embeddings=131072, rope_theta=500000.0,
                      rope_scaling={**LLAMA3_ROPE, "original_max_position_embeddings": 8192}), 128),
    # DeepSeek-V3: YaRN over the 64 RoPE channels, 4k to 160k, its mscales (cos/sin factor 1).
    "deepseek-v3-yarn": (dict(head_dim=64, max_position_embeddings=163840, rope_theta=10000.0,
                              rope_scaling={"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                                            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}), 64),
    # Qwen3's long context: YaRN 4x over 32k, cos/sin times 0.1 ln 4 + 1.
    "qwen3-yarn": (dict(head_dim=128, max_position_embeddings=131072, rope_theta=1000000.0,
                        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}), 128),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_rope_scaling_is_transformers_frequencies(case):
    """The scaled inverse frequencies and the cos/sin factor are transformers' own (the oracle), and
    differ from plain RoPE."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from scaling.nn import RotaryEmbedding
    from scaling.transformer.hf import _rope_from_hf

    fields, dim = ROPE_CASES[case]
    hf_config = transformers.LlamaConfig(hidden_size=32, num_attention_heads=4, **fields)
    rope_type = fields["rope_scaling"]["rope_type"]
    expected, factor = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
    theta, scaling = _rope_from_hf(hf_config.to_dict(), Path("config.json"))
    ours = RotaryEmbedding(dim, base=theta, scaling=scaling.to_nn())
    torch.testing.assert_close(ours.inv_freq, expected, rtol=1e-6, atol=0)
    assert ours.cos_sin_factor == pytest.approx(factor, rel=1e-12)
    assert not torch.allclose(RotaryEmbedding(dim, base=theta).inv_freq, expected)


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (
            {"rope_parameters": {"rope_type": "longrope", "factor": 4.0, "rope_theta": 1e6}},
            "rope_type='longrope' is not supported; import-hf reads 'default', 'linear', 'llama3' and 'yarn'",
        ),
        ({"use_sliding_window": True}, "use_sliding_window=True, layer_types with [] is not supported"),
        ({"mlp_only_layers": [0]}, "mlp_only_layers=[0] is not supported"),
        ({"attention_bias": True}, "attention_bias=True is not supported for model_type='qwen3_moe'"),
    ],
    ids=["longrope", "sliding-window", "mlp-only-layers", "qwen3-attention-bias"],
)
def test_unsupported_settings_are_refused_naming_them(tmp_path, change, said):
    model_cls, config = _family("qwen3-moe")
    _saved(tmp_path, model_cls, config())
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(ValueError, match=re.escape(said)):
        import_hf(tmp_path / "hf", tmp_path / "ours")
    assert not (tmp_path / "ours").exists()


def test_peft_export_of_latent_attention_is_refused_before_anything_is_written(tmp_path):
    model_cls, config = _family("deepseek-v3")
    _saved(tmp_path, model_cls, config())
    import_hf(tmp_path / "hf", tmp_path / "ours")
    with pytest.raises(ValueError, match="PEFT adapters of a model with latent attention"):
        export_peft(tmp_path / "ours" / CHECKPOINT_SUBDIR, tmp_path / "adapter")
    assert not (tmp_path / "adapter").exists()


def test_a_missing_tensor_is_refused_naming_it(tmp_path):
    from safetensors.torch import load_file, save_file

    model_cls, config = _family("qwen3")
    _saved(tmp_path, model_cls, config())
    state = load_file(tmp_path / "hf" / "model.safetensors")
    del state["model.layers.1.self_attn.k_norm.weight"]
    save_file(state, tmp_path / "hf" / "model.safetensors")
    with pytest.raises(ValueError, match=r"lack 1 tensor\(s\) .*'model.layers.1.self_attn.k_norm.weight'"):
        import_hf(tmp_path / "hf", tmp_path / "ours")


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("family", "layout"),
    [
        ("llama3.1", {"tp": 2}),
        ("qwen3", {"tp": 2}),
        ("qwen2.5", {"pp": 2}),
        ("qwen3-moe", {"dp": 2, "topology": {"expert_parallel_size": 2}}),
        ("qwen3-moe", {"tp": 2}),
        pytest.param("qwen3-moe-sparse-step", {"pp": 2}, marks=pytest.mark.slow),
        ("deepseek-v3", {"tp": 2}),
        ("deepseek-v3", {"dp": 2, "topology": {"expert_parallel_size": 2}}),
        pytest.param("llama3.2", {"tp": 2}, marks=pytest.mark.slow),
        pytest.param("qwen2.5", {"tp": 2}, marks=pytest.mark.slow),
        pytest.param("deepseek-v3-no-q-latent", {"pp": 2}, marks=pytest.mark.slow),
    ],
    ids=[
        "llama3.1-tp2",
        "qwen3-tp2",
        "qwen2.5-pp2",
        "qwen3-moe-ep2",
        "qwen3-moe-tp2",
        "qwen3-moe-pp2",
        "deepseek-v3-tp2",
        "deepseek-v3-ep2",
        "llama3.2-tp2",
        "qwen2.5-tp2",
        "deepseek-v3-pp2",
    ],
)
def test_imported_family_gives_transformers_logits_at_a_layout(tiny_corpus, tmp_path, family, layout):
    """import-hf, then the model at a multi-rank layout (its trainer loading the import): the logits of
    every last-stage rank are transformers' (fp32, 1e-5)."""
    model_cls, config = _family(family, vocab_size=TINY_VOCAB)
    hf_model = _saved(tmp_path, model_cls, config())
    assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "ours")]) == 0
    sizes = {k: v for k, v in layout.items() if k != "topology"}
    load = {
        "load_dir": str(tmp_path / "ours" / CHECKPOINT_SUBDIR),
        "load_optimizer_states": False,
        "load_context": False,
    }
    cfg = tiny_config(tiny_corpus, **sizes, trainer=load, topology=layout.get("topology", {}))
    cfg["transformer_architecture"] = yaml.safe_load((tmp_path / "ours" / "config.yml").read_text())[
        "transformer_architecture"
    ]
    ids = torch.randint(0, TINY_VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = hf_model(ids).logits
    results = run_distributed(logits_worker, cfg["runner"]["nproc_per_node"], cfg, ids, timeout_seconds=180)
    last = [r for r in results if r is not None]
    assert len(last) == (2 if "pp" not in sizes else 1)
    for logits in last:
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.distributed
def test_the_export_folder_loads_with_auto_classes_and_a_pipeline(tiny_corpus, tmp_path, capsys):
    save = tmp_path / "ckpt"
    cfg = tiny_config(tiny_corpus, steps=2, trainer={"save_dir": str(save), "save_interval": 2})
    run_distributed(train_worker, 1, cfg, timeout_seconds=120)
    assert main(["export-hf", str(save), str(tmp_path / "hf")]) == 0
    assert "model.safetensors, tokenizer; base weights only" in capsys.readouterr().out
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    from tokenizers import Tokenizer

    ours = Tokenizer.from_file(str(tiny_corpus / "tokenizer.json"))
    assert tokenizer("def f(x):")["input_ids"] == ours.encode("def f(x):").ids
    assert tokenizer.eos_token == "<|endoftext|>" and model.generation_config.eos_token_id == ours.token_to_id(
        "<|endoftext|>"
    )
    pipe = transformers.pipeline("text-generation", model=str(tmp_path / "hf"))
    [out] = pipe("def ", max_new_tokens=8, do_sample=False)
    # The same greedy continuation as our own generate from the checkpoint.
    from scaling.transformer.generate import generate_text

    assert out["generated_text"] == generate_text(save, ["def "], max_new_tokens=8)[0]


def test_export_names_a_missing_tokenizer(tmp_path, capsys, monkeypatch, tiny_corpus):
    # A `preprocess` run in the working folder left the default corpus's tokenizer (300 tokens) there:
    # it is another model's (the imported one has 101), so it is not shipped and the export succeeds.
    default = tmp_path / "cwd" / "runs/transformer/corpus"
    default.mkdir(parents=True)
    (default / "tokenizer.json").write_bytes((tiny_corpus / "tokenizer.json").read_bytes())
    monkeypatch.chdir(tmp_path / "cwd")
    _tiny_llama(tmp_path)
    assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "ours")]) == 0
    ckpt = str(tmp_path / "ours" / CHECKPOINT_SUBDIR)
    assert main(["export-hf", ckpt, str(tmp_path / "back")]) == 0  # no tokenizer anywhere: said, not fatal
    assert "pass --tokenizer to ship one" in capsys.readouterr().out
    assert not (tmp_path / "back" / "tokenizer.json").exists()
    with pytest.raises(FileNotFoundError, match="--tokenizer 'nope.json' does not exist"):
        export_hf(ckpt, tmp_path / "again", tokenizer="nope.json")


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--max-new-tokens", "-1"], "max_new_tokens=-1 must be >= 0 (--max-new-tokens)"),
        (["--temperature", "nan"], "temperature=nan must be a finite number >= 0"),
        (["--top-p", "1.5"], "top_p=1.5 must be in (0, 1]"),
        (["--prompt", b"def \xff".decode("utf-8", "surrogateescape")], "is not valid UTF-8"),
        (["--tokenizer", "NOT_A_TOKENIZER"], "is not a tokenizers JSON file"),
        (["--tokenizer", "missing.json"], "tokenizer 'missing.json' not found"),
    ],
    ids=["max-new-tokens", "temperature", "top-p", "utf-8", "not-a-tokenizer", "missing-tokenizer"],
)
def test_generate_refuses_bad_arguments_in_one_line(tmp_path, capsys, monkeypatch, args, said):
    _tiny_llama(tmp_path)
    assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "ours")]) == 0
    (tmp_path / "NOT_A_TOKENIZER").write_text("this is not json")
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    code = main(["generate", "--checkpoint", str(tmp_path / "ours" / CHECKPOINT_SUBDIR), *args])
    err = capsys.readouterr().err
    assert code == 2 and said in err and len(err.splitlines()) == 1, err


def _hf_folder_and_import(tmp_path):
    _tiny_llama(tmp_path)
    assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "ours")]) == 0
    (tmp_path / "a_file").write_text("")
    bad_json = tmp_path / "bad_json"
    bad_json.mkdir()
    (bad_json / "config.json").write_text("{x")
    truncated = tmp_path / "truncated"
    truncated.mkdir()
    (truncated / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    (truncated / "model.safetensors").write_bytes((tmp_path / "hf" / "model.safetensors").read_bytes()[:3000])


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["import-hf", "bad_json", "out"], "bad_json/config.json is not valid JSON (Expecting property name"),
        (["import-hf", "truncated", "out"], "truncated/model.safetensors is not a readable safetensors file"),
        (["import-hf", "hf", "a_file"], "output 'a_file' exists and is not a folder; give a folder to write into"),
        (["export-hf", "ours/checkpoint", "a_file"], "output 'a_file' exists and is not a folder"),
        (
            ["export-hf", "ours", "back"],
            "holds no committed checkpoint (step_*/commit.json); did you mean 'ours/checkpoint'?",
        ),
        (
            ["export-hf", "ours/checkpoint", "back", "--peft-dir", "peft"],
            "finetuning.method='none' in the checkpoint's config; a PEFT adapter needs",
        ),
    ],
    ids=["bad-json", "truncated-safetensors", "import-into-file", "export-into-file", "import-root", "peft-no-lora"],
)
def test_import_and_export_refuse_bad_arguments_in_one_line(tmp_path, capsys, monkeypatch, args, said):
    """Exit 2 and one line naming the argument; nothing written (the PEFT refusal comes before the export)."""
    _hf_folder_and_import(tmp_path)
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    code = main(args)
    err = capsys.readouterr().err
    assert code == 2 and said in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out").exists() and not (tmp_path / "back").exists()


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("family", ["qwen3-moe", "deepseek-v3", "qwen3"])
def test_export_of_a_model_trained_at_dp2_tp2_pp2_loads_in_transformers(tiny_corpus, tmp_path, family):
    """import-hf, train 2 steps at dp2·tp2·pp2 (8 ranks; the MoE families with ep2), export-hf:
    from_pretrained gives the logits of our one-process model of that checkpoint (1e-5) and the
    same greedy tokens, and the weights moved (the export is of the trained model, not the import)."""
    model_cls, config = _family(family, vocab_size=TINY_VOCAB)
    hf_model = _saved(tmp_path, model_cls, config())
    assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "ours")]) == 0
    save = tmp_path / "trained"
    trainer = {"load_dir": str(tmp_path / "ours" / CHECKPOINT_SUBDIR), "load_optimizer_states": False,
               "load_context": False, "save_dir": str(save), "save_interval": 2}  # fmt: skip
    ep = {"expert_parallel_size": 2} if "moe" in family or "deepseek" in family else {}
    cfg = tiny_config(tiny_corpus, dp=2, tp=2, pp=2, steps=2, trainer=trainer, topology=ep)
    cfg["transformer_architecture"] = yaml.safe_load((tmp_path / "ours" / "config.yml").read_text())[
        "transformer_architecture"
    ]
    run_distributed(train_worker, 8, cfg, timeout_seconds=300)
    assert main(["export-hf", str(save), str(tmp_path / "back")]) == 0
    ours, _ = load_model(save)
    back = model_cls.from_pretrained(tmp_path / "back").eval()
    ids = torch.randint(0, TINY_VOCAB, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = ours(ids)
        torch.testing.assert_close(back(ids).logits, expected, rtol=1e-5, atol=1e-5)
        assert (expected - hf_model(ids).logits).abs().max() > 1e-4  # trained: not the imported weights
    prompt = ids[:1, :5]
    hf_tokens = back.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)[0, 5:].tolist()
    assert generate(ours, [prompt[0].tolist()], 8) == [hf_tokens]
