"""The GPU tier: tests marked ``gpu`` need CUDA and skip (with the reason) without it.

They run the apps' own test helpers (``mlp_testlib``, ``transformer_testlib``) and the auto
API's (``auto_models``), so those test folders go on ``sys.path`` here (the pooled workers get
the same path).
"""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
for folder in (
    ROOT / "apps" / "mlp" / "tests",
    ROOT / "apps" / "transformer" / "tests",
    ROOT / "packages" / "scaling-trainer" / "tests" / "auto",
):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from transformer_testlib import build_tiny_corpus  # noqa: E402


@pytest.fixture(scope="session")
def gpu_corpus(tmp_path_factory):
    return build_tiny_corpus(tmp_path_factory.mktemp("gpu_corpus"))
