import json
from importlib.metadata import entry_points

import numpy as np
import pytest

from scaling.data import MMapTokenDataset, tokenize_files
from scaling.data._cli import main

tokenizers = pytest.importorskip("tokenizers")

TEXTS = [
    "the quick brown fox jumps over the lazy dog",
    "a distributed loader shards the global batch over data parallel ranks",
    "memory mapped tokens are read without copying",
    "pack windows across documents and mask attention per document",
] * 3


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    """A tiny BPE trained in-process: no download."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=120, special_tokens=["[UNK]", "</s>"])
    tok.train_from_iterator(TEXTS, trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture
def inputs(tmp_path):
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(TEXTS[:6])) + "\n")
    txt = tmp_path / "b.txt"
    txt.write_text("\n".join(TEXTS[6:]) + "\n")
    return [jsonl, txt]


def test_build_matches_tokenizer(tokenizer_file, inputs, tmp_path):
    assert (
        main(
            [
                "build",
                *map(str, inputs),
                "--tokenizer",
                str(tokenizer_file),
                "--output",
                str(tmp_path / "out"),
                "--workers",
                "1",
                "--eod-token",
                "</s>",
                "--no-progress",
            ]
        )
        == 0
    )
    ds = MMapTokenDataset(tmp_path / "out", verify_data=True)
    tok = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    eod = tok.token_to_id("</s>")
    assert ds.dtype == np.uint8  # vocabulary of 120 fits
    assert len(ds) == len(TEXTS)
    for doc, text in zip(ds, TEXTS):
        assert doc.tolist() == tok.encode(text, add_special_tokens=False).ids + [eod]


def test_parallel_build_gives_identical_files(tokenizer_file, inputs, tmp_path, capsys):
    tokenize_files(inputs, tokenizer_file, tmp_path / "one", num_workers=1, chunk_size=2, progress=False)
    args = ["build", *map(str, inputs), "--tokenizer", str(tokenizer_file), "--output", str(tmp_path / "two")]
    assert main([*args, "--workers", "2", "--chunk-size", "2", "--dtype", "uint16"]) == 0
    out = capsys.readouterr()
    assert f"{len(TEXTS)} documents" in out.out and "tokenize" in out.err  # the tqdm bar
    one, two = MMapTokenDataset(tmp_path / "one"), MMapTokenDataset(tmp_path / "two", dtype=np.uint16)
    assert [d.tolist() for d in one] == [d.tolist() for d in two]


def test_console_script_is_installed():
    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "scaling-data"]
    assert script.value == "scaling.data._cli:main" and script.load() is main


def test_build_errors(tokenizer_file, inputs, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: no string field 'text' \(keys: \['body'\]\)"):
        tokenize_files([bad], tokenizer_file, tmp_path / "x", progress=False)
    assert not list(tmp_path.glob("x.*"))  # an aborted build leaves no files
    bad.write_text("{not json\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: not valid JSON"):
        tokenize_files([bad], tokenizer_file, tmp_path / "x", progress=False)
    with pytest.raises(ValueError, match=r"suffix '\.csv' is not supported; use one of \.jsonl, \.txt"):
        (tmp_path / "c.csv").write_text("a")
        tokenize_files([tmp_path / "c.csv"], tokenizer_file, tmp_path / "x", progress=False)
    with pytest.raises(ValueError, match=r"eod_token='<eos>' is not in the vocabulary"):
        tokenize_files(inputs, tokenizer_file, tmp_path / "x", eod_token="<eos>", progress=False)
    assert main(["build", str(tmp_path / "missing.txt"), "--tokenizer", str(tokenizer_file), "--output", "x"]) == 2
    assert "missing.txt does not exist" in capsys.readouterr().err
    bad.write_bytes(b'{"text": "ok"}\n{"text": "fine"}\n{"text": "caf\xe9"}\n')  # latin-1 on line 3
    assert main(["build", str(bad), "--tokenizer", str(tokenizer_file), "--output", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl:3: not valid UTF-8" in err.splitlines()[-1] and "Traceback" not in err, err
    (tmp_path / "whole.txt").write_bytes(b"one\ntwo\n\xff three\n")
    with pytest.raises(ValueError, match=r"whole\.txt:3: not valid UTF-8"):
        tokenize_files([tmp_path / "whole.txt"], tokenizer_file, tmp_path / "x", progress=False, txt_whole_file=True)
    (tmp_path / "not_a_tokenizer.json").write_text("[1, 2]")
    args = ["build", str(inputs[0]), "--tokenizer", str(tmp_path / "not_a_tokenizer.json"), "--output", "x"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "not_a_tokenizer.json' is not a tokenizers JSON file" in err.splitlines()[-1] and "Traceback" not in err


def test_inspect(tokenizer_file, inputs, tmp_path, capsys):
    tokenize_files(inputs, tokenizer_file, tmp_path / "i", progress=False)
    assert main(["inspect", str(tmp_path / "i")]) == 0
    assert f"{len(TEXTS)} documents" in capsys.readouterr().out
    data = bytearray((tmp_path / "i.bin").read_bytes())
    data[0] ^= 1
    (tmp_path / "i.bin").write_bytes(data)
    assert main(["inspect", str(tmp_path / "i")]) == 2
    assert "corrupted: the token data do not match the CRC-32" in capsys.readouterr().err
