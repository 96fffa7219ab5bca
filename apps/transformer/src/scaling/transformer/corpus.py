"""The embedded default corpus: Python standard-library sources, a locally trained BPE.

Nothing is downloaded. The documents are the source files (code, comments and
docstrings) of a fixed list of pure-Python standard-library modules, read through
``inspect.getsourcefile``; every tenth document goes to the validation split. The
corpus therefore depends only on the Python version. A byte-level BPE tokenizer is
trained on the training split with Hugging Face ``tokenizers`` and both splits are
written as memory-mapped token files (``scaling.data.tokenize_files``).
"""

from __future__ import annotations

import importlib
import inspect
import json
import sys
from pathlib import Path
from typing import Any

from scaling.config import JsonDict

STDLIB_MODULES = (
    "argparse", "ast", "base64", "bisect", "calendar", "cmd", "codecs", "colorsys", "configparser",
    "contextlib", "copy", "csv", "dataclasses", "datetime", "difflib", "enum", "fnmatch", "fractions",
    "ftplib", "functools", "getopt", "gettext", "glob", "gzip", "heapq", "hmac", "html.parser",
    "imaplib", "inspect", "ipaddress", "json.decoder", "json.encoder", "locale", "logging",
    "mailbox", "mimetypes", "numbers", "operator", "optparse", "pathlib", "pickle", "pprint",
    "queue", "quopri", "random", "sched", "secrets", "selectors", "shlex", "shutil", "smtplib",
    "statistics", "string", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "timeit",
    "tokenize", "traceback", "types", "typing", "uuid", "warnings", "wave", "weakref", "zipfile",
)  # fmt: skip
EOD_TOKEN = "<|endoftext|>"
DEFAULT_VOCAB_SIZE = 1024


def default_paths(corpus_dir: str | Path) -> dict[str, Path]:
    """Where ``preprocess`` puts things: token prefixes, the tokenizer and a summary."""
    root = Path(corpus_dir)
    return {
        "train": root / "train",
        "validation": root / "validation",
        "tokenizer": root / "tokenizer.json",
        "summary": root / "corpus.json",
    }


def stdlib_documents(modules: tuple[str, ...] = STDLIB_MODULES) -> list[tuple[str, str]]:
    """``(module name, source text)`` of each module that ships as Python source, in order."""
    docs = []
    for name in modules:
        try:
            module = importlib.import_module(name)
            path = inspect.getsourcefile(module)
        except (ImportError, TypeError):
            continue  # a build of Python without this module, or one shipping only bytecode
        if path is not None and Path(path).is_file():
            docs.append((name, Path(path).read_text(encoding="utf-8")))
    return docs


# Any: a tokenizers.Tokenizer (the package is optional and has no type information).
def train_tokenizer(texts: list[str], vocab_size: int, path: Path) -> Any:
    """A byte-level BPE (GPT-2 style) with ``<|endoftext|>`` as id 0, saved to ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return tokenizer


def preprocess(
    corpus_dir: str | Path, vocab_size: int = DEFAULT_VOCAB_SIZE, modules: tuple[str, ...] = STDLIB_MODULES
) -> JsonDict:
    """Build the default corpus in ``corpus_dir``; returns the summary (also in ``corpus.json``).

    Raises:
        ValueError: when ``vocab_size`` cannot hold the 256 byte symbols plus the EOD token.
    """
    if vocab_size < 257:
        raise ValueError(f"vocab_size={vocab_size} is too small for a byte-level BPE; use at least 257")
    paths = default_paths(corpus_dir)
    docs = stdlib_documents(modules)
    splits: dict[str, list[tuple[str, str]]] = {"train": [], "validation": []}
    for i, doc in enumerate(docs):
        splits["validation" if i % 10 == 9 else "train"].append(doc)
    train_tokenizer([text for _, text in splits["train"]], vocab_size, paths["tokenizer"])
    summary: JsonDict = {
        "python": sys.version.split()[0],
        "vocab_size": vocab_size,
        "tokenizer": str(paths["tokenizer"]),
    }
    for split, split_docs in splits.items():
        jsonl = Path(corpus_dir) / f"{split}.jsonl"
        with jsonl.open("w", encoding="utf-8") as f:
            for _, text in split_docs:
                f.write(json.dumps({"text": text}) + "\n")
        from scaling.data import tokenize_files  # here: scaling.data imports torch

        tokens = tokenize_files(
            [jsonl], paths["tokenizer"], paths[split], eod_token=EOD_TOKEN, progress=False, num_workers=1
        )
        jsonl.unlink()
        summary[split] = {
            "prefix": str(paths[split]),
            "modules": [name for name, _ in split_docs],
            "documents": tokens.num_documents,
            "tokens": tokens.num_tokens,
        }
    paths["summary"].write_text(json.dumps(summary, indent=2))
    return summary
