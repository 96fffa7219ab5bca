"""Repository-wide pytest hooks.

- GPU tests are skipped, with the reason, without CUDA.
- Tests marked ``slow`` run first: under pytest-xdist (``nox -s tests`` runs ``-n``) the
  long ones then start while the short ones fill the other workers, instead of one long
  test starting last and running alone. The one marked ``heavy`` (the transformer README
  session, a fifth of the suite's CPU) starts before all of them. Those marked ``waits``
  (they sit out a timeout on purpose, the CPU idle) are spread out among the computing slow
  tests: when several started together, as collection order had them, both cores idled
  for ~10 s.
- Under xdist each worker, and every process it launches (pooled ranks, torchrun), gets
  its share of the cores as intra-op threads: two workers on two cores each taking both
  cores' worth of OpenMP threads spend their time spinning against each other.
- The cyclic garbage collector is off while torch and the test modules import (their
  hundreds of thousands of objects would trigger collection after collection, ~20 % of an
  import's CPU), and on again after collection with everything imported so far frozen out of
  its sight (full collections would otherwise walk it all again: ~12 % of the CPU samples,
  most in the test process, in a profile of the distributed tests before this).
- The pooled ranks' forkserver imports Hugging Face's model classes and peft once, instead
  of every worker whose test builds a transformers model importing them (~2 s of CPU each,
  up to eight workers a pool); packages' own ``package_tests`` environments without them
  skip the missing modules.
"""

import gc

gc.disable()

import os  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from scaling.testing import preload  # noqa: E402

preload(
    "transformers.models.gpt2.modeling_gpt2",
    "transformers.models.llama.modeling_llama",
    "peft",
    "scaling.trainer.auto",
)

_XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if _XDIST_WORKERS > 1:
    _threads = str(max(1, (os.cpu_count() or 1) // _XDIST_WORKERS))
    os.environ["OMP_NUM_THREADS"] = _threads
    torch.set_num_threads(int(_threads))


def _start_order(items):
    kinds = {"heavy": [], "waits": [], "slow": [], "quick": []}
    for item in items:
        kinds[next((k for k in ("heavy", "waits", "slow") if item.get_closest_marker(k)), "quick")].append(item)
    waits, slow = kinds["waits"], kinds["slow"]
    # One waiting test after every `gap` computing slow ones, so that on two cores and three
    # workers a waiting worker leaves the cores to the other two.
    gap = max(1, len(slow) // (len(waits) + 1))
    order = list(kinds["heavy"])
    for n, item in enumerate(slow, 1):
        order.append(item)
        if n % gap == 0 and waits:
            order.append(waits.pop(0))
    return order + waits + kinds["quick"]


def pytest_collection_modifyitems(config, items):
    items[:] = _start_order(items)  # within each kind, collection order
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device; none is present on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def pytest_collection_finish(session):
    gc.freeze()
    gc.enable()
