"""Makes this folder's helper module (transformer_testlib) importable by name, here and in workers."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import pytest
from transformer_testlib import build_tiny_corpus


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory):
    return build_tiny_corpus(tmp_path_factory.mktemp("corpus"))
