"""The README's session, as a new user runs it: preprocess, train the bundled config, generate."""

import json

import pytest

from scaling.transformer.__main__ import main

# The bar stated in the README: the bundled config on the default corpus, one CPU process.
THRESHOLD, STEPS = 4.6, 200


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.distributed
def test_readme_session_preprocess_train_generate(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the bundled config writes under ./runs/transformer, like a user's shell
    assert main(["preprocess"]) == 0
    assert main(["train"]) == 0
    lines = (tmp_path / "runs/transformer/metrics.jsonl").read_text().splitlines()
    evals = {m["step"]: m["evaluation/loss"] for m in map(json.loads, lines) if "evaluation/loss" in m}
    assert max(evals) == STEPS and evals[STEPS] < THRESHOLD, evals
    capsys.readouterr()
    args = ["generate", "--checkpoint", "runs/transformer/checkpoints", "--prompt", "def ", "--max-new-tokens", "16"]
    assert main([*args, "--temperature", "0.8", "--top-p", "0.9"]) == 0
    out = capsys.readouterr().out
    # The prompt, then generated text (which may start on a new line: sampling decides).
    assert out.startswith("def ") and out[len("def ") :].strip(), out
