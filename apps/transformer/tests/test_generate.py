"""Generation in one process: checkpoints of any layout, KV cache, sampling, padded batches, the CLI."""

import pytest
import torch
from transformer_testlib import tiny_config, train_worker

from scaling.testing import assert_parity, run_distributed
from scaling.transformer.__main__ import main
from scaling.transformer.config import TransformerArchitectureConfig
from scaling.transformer.generate import generate, sample_next
from scaling.transformer.inference import TransformerLM, load_model

ARCH = dict(vocab_size=97, hidden_size=32, num_layers=2, num_attention_heads=4, num_kv_heads=2, max_sequence_length=40)


@pytest.fixture(scope="module")
def model():
    return TransformerLM(TransformerArchitectureConfig(**ARCH), seed=3).eval()


def _greedy_without_cache(model, prompt, n):
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]


def test_kv_cache_greedy_equals_recomputation(model):
    prompt = [5, 17, 3, 88, 41]
    assert generate(model, [prompt], 12) == [_greedy_without_cache(model, prompt, 12)]


def test_batched_prompts_of_different_lengths_equal_one_by_one(model):
    prompts = [[5, 17, 3, 88, 41, 9, 2], [60], [7, 7, 1]]
    batched = generate(model, prompts, 8)
    assert batched == [generate(model, [p], 8)[0] for p in prompts]
    assert batched[1] == _greedy_without_cache(model, prompts[1], 8)


def test_sampling_controls(model):
    logits = torch.randn(4, 97, generator=torch.Generator().manual_seed(0))
    greedy = logits.argmax(-1)
    assert torch.equal(sample_next(logits, temperature=1.0, top_k=1), greedy)
    assert torch.equal(sample_next(logits, temperature=1.0, top_p=1e-6), greedy)
    top5 = logits.topk(5, dim=-1).indices
    draws = torch.stack(
        [sample_next(logits, 2.0, top_k=5, generator=torch.Generator().manual_seed(s)) for s in range(50)]
    )
    assert all(bool((top5[i] == draws[:, i, None]).any(-1).all()) for i in range(4))
    assert len(set(draws[:, 0].tolist())) > 1  # it samples, not argmax
    a = generate(model, [[1, 2, 3]], 10, temperature=0.8, top_p=0.9, seed=7)
    assert a == generate(model, [[1, 2, 3]], 10, temperature=0.8, top_p=0.9, seed=7)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"temperature": -1.0}, "temperature=-1.0 must be a finite number >= 0"), ({"top_k": 0}, "top_k=0 must be >= 1"),
     ({"top_p": 1.5}, r"top_p=1.5 must be in \(0, 1\]")],
)  # fmt: skip
def test_bad_sampling_arguments(model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        generate(model, [[1]], 2, **kwargs)


def test_sequence_longer_than_configured_positions(model):
    with pytest.raises(ValueError, match="= 45 exceeds transformer_architecture.max_sequence_length=40"):
        generate(model, [[1] * 35], 10)


def _save_config(corpus, save_dir, tp=1, pp=1):
    return tiny_config(corpus, tp=tp, pp=pp, steps=2, trainer={"save_dir": str(save_dir), "save_interval": 2})


@pytest.mark.slow
@pytest.mark.distributed
def test_checkpoint_of_any_layout_loads_in_one_process(tiny_corpus, tmp_path, capsys):
    run_distributed(train_worker, 1, _save_config(tiny_corpus, tmp_path / "one"), timeout_seconds=120)
    run_distributed(train_worker, 4, _save_config(tiny_corpus, tmp_path / "tp2pp2", 2, 2), timeout_seconds=180)
    one, _ = load_model(tmp_path / "one")
    other, config = load_model(tmp_path / "tp2pp2")
    assert config.topology.model_parallel_size == 2 and config.topology.pipe_parallel_size == 2
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_parity(other(ids), one(ids), rtol=1e-5, atol=1e-5, name="logits tp2pp2 vs one process")
    assert (
        main(["generate", "--checkpoint", str(tmp_path / "tp2pp2"), "--prompt", "def ", "--max-new-tokens", "8"]) == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("def ") and len(out.splitlines()[0]) > len("def ")
