"""Data from config: prompt/completion JSONL (loss on the completion only) and weighted blends."""

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from transformer_testlib import TINY_VOCAB, losses, tiny_config, train_worker

from scaling.data import BlendedDataset, MMapTokenBuilder
from scaling.testing import run_distributed
from scaling.transformer.__main__ import main
from scaling.transformer.config import TransformerArchitectureConfig, TransformerConfig
from scaling.transformer.corpus import EOD_TOKEN, default_paths
from scaling.transformer.datasets import build_datasets
from scaling.transformer.inference import TransformerLM
from scaling.transformer.jsonl import PromptCompletionDataset
from scaling.transformer.model import TransformerHeadOutput, TransformerLoss

EXAMPLES = [
    ("def add(a, b):", " return a + b"),
    ("# sort the list\n", "items.sort()"),
    ("import ", "heapq"),
]


def _jsonl(path, examples=EXAMPLES):
    path.write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in examples))
    return path


def _tokenizer(corpus):
    return Tokenizer.from_file(str(default_paths(corpus)["tokenizer"]))


def test_mask_covers_the_completion_only(tiny_corpus, tmp_path):
    tok = _tokenizer(tiny_corpus)
    ds = PromptCompletionDataset(_jsonl(tmp_path / "ft.jsonl"), tok, 16, TINY_VOCAB)
    eod = tok.token_to_id(EOD_TOKEN)
    for i, (prompt, completion) in enumerate(EXAMPLES):
        p, c = tok.encode(prompt).ids, tok.encode(completion).ids + [eod]
        item = ds[i]
        assert item.input_token_ids[: len(p)].tolist() == p
        # Target j predicts token j + 1: weight 1 exactly on completion tokens and the closing <eod>.
        expected = [1.0 if len(p) <= j + 1 < len(p) + len(c) else 0.0 for j in range(16)]
        assert item.loss_weights.tolist() == expected
        assert [t for t, w in zip(item.target_token_ids.tolist(), expected) if w] == c[: int(sum(expected))]


def test_loss_equals_cross_entropy_over_completion_tokens(tiny_corpus, tmp_path):
    tok = _tokenizer(tiny_corpus)
    ds = PromptCompletionDataset(_jsonl(tmp_path / "ft.jsonl"), tok, 16, TINY_VOCAB)
    batch = ds.collate([ds[i] for i in range(len(EXAMPLES))])
    arch = TransformerArchitectureConfig(vocab_size=TINY_VOCAB, hidden_size=32, num_layers=2, num_attention_heads=4)
    model = TransformerLM(arch, seed=1).eval()
    with torch.no_grad():
        logits = model(batch.input_token_ids)
        loss, _ = TransformerLoss(TINY_VOCAB, None)(TransformerHeadOutput(logits), batch)
    # By hand: every completion target of every example, from the examples' own token counts.
    terms = []
    for i, (prompt, completion) in enumerate(EXAMPLES):
        n_p, n_c = len(tok.encode(prompt).ids), len(tok.encode(completion).ids) + 1
        for j in range(n_p - 1, min(n_p + n_c - 1, 16)):
            terms.append(F.cross_entropy(logits[i, j], batch.target_token_ids[i, j]))
    torch.testing.assert_close(loss, torch.stack(terms).mean(), rtol=1e-6, atol=1e-6)
    unmasked = F.cross_entropy(logits.flatten(0, 1), batch.target_token_ids.flatten())
    assert not torch.isclose(loss, unmasked)


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("{not json", r"ft.jsonl:2: not valid JSON"),
        ('{"prompt": "x"}', r"ft.jsonl:2: field 'completion' is None; every line needs string fields"),
        ('{"prompt": "' + "x = 1 " * 40 + '", "completion": "y"}', r"example 2 has a \d+-token prompt, which fills"),
    ],
    ids=["json", "field", "too-long"],
)
def test_bad_jsonl_is_refused(tiny_corpus, tmp_path, line, match):
    path = tmp_path / "ft.jsonl"
    path.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=match):
        PromptCompletionDataset(path, _tokenizer(tiny_corpus), 16, TINY_VOCAB)


@pytest.mark.distributed
def test_finetuning_jsonl_from_config_trains(tiny_corpus, tmp_path):
    path = _jsonl(tmp_path / "ft.jsonl")
    cfg = tiny_config(tiny_corpus, steps=8, data={"finetuning_jsonl": str(path)})
    (history,) = run_distributed(train_worker, 1, cfg, timeout_seconds=120)
    out = losses(history)
    assert len(out) == 8 and all(math.isfinite(x) for x in out) and out[-1] < out[0]


def test_missing_jsonl_is_refused_before_launch(capsys, tiny_corpus, tmp_path):
    cfg = TransformerConfig.from_dict(tiny_config(tiny_corpus))
    cfg.save(tmp_path / "c.yml")
    assert main(["train", str(tmp_path / "c.yml"), f"data.finetuning_jsonl={tmp_path / 'none.jsonl'}"]) == 2
    assert "data.finetuning_jsonl=" in capsys.readouterr().err


def _tokens(prefix, low, docs=20, length=40, seed=0):
    rng = np.random.default_rng(seed)
    with MMapTokenBuilder(prefix) as builder:
        for _ in range(docs):
            builder.add_document(rng.integers(low, low + 50, length))
    return prefix


@pytest.fixture
def two_sources(tmp_path):
    return _tokens(tmp_path / "a", 1), _tokens(tmp_path / "b", 150, seed=1)


def test_blend_proportions_follow_the_weights(tiny_corpus, two_sources):
    a, b = two_sources
    blend = [{"prefix": str(a), "weight": 1.0}, {"prefix": str(b), "weight": 3.0}]
    config = TransformerConfig.from_dict(tiny_config(tiny_corpus, steps=40, data={"blend": blend}))
    dataset, _ = build_datasets(config)
    assert isinstance(dataset, BlendedDataset) and len(dataset) == 40 * 8
    source = dataset.dataset_index
    assert abs(int((source == 0).sum()) - 80) <= 1 and abs(int((source == 1).sum()) - 240) <= 1
    for i in range(0, len(dataset), 37):  # each sample really comes from its source's token range
        tokens = dataset[i].input_token_ids
        assert (tokens < 51).all() if source[i] == 0 else (tokens >= 150).all()
    assert abs(int((source[:100] == 1).sum()) - 75) <= 1  # interleaved, not one source after the other


@pytest.mark.distributed
def test_blend_from_config_trains(tiny_corpus, two_sources):
    a, b = two_sources
    blend = [{"prefix": str(a), "weight": 1.0}, {"prefix": str(b), "weight": 1.0}]
    (history,) = run_distributed(train_worker, 1, tiny_config(tiny_corpus, steps=3, data={"blend": blend}))
    assert len(losses(history)) == 3


def test_two_training_sources_are_refused(tiny_corpus, two_sources):
    a, _ = two_sources
    with pytest.raises(ValueError, match="data.data_prefix and data.blend are both set; choose one"):
        TransformerConfig.from_dict(
            tiny_config(tiny_corpus, data={"data_prefix": str(a), "blend": [{"prefix": str(a), "weight": 1}]})
        )
