"""Seeding and the TP-aware RNG tracker.

Two streams, as in Megatron-LM:

* the default generators (python, numpy, torch CPU and CUDA) are seeded with
  ``seed + 100 * pipe_parallel_rank``: identical across a TP group and across DP, so
  dropout on activations that are replicated over TP draws the same mask everywhere;
* the tracker's ``"model-parallel-rng"`` stream is seeded with
  ``seed + 2718 + model_parallel_rank``: different per TP rank, for dropout on
  activations that are sharded over TP (e.g. attention probabilities per head).

Activation checkpointing reproduces masks because the tracker's states and the default
generator are captured before the forward and restored for the recomputation.

Seeds fix the random numbers; on GPUs the kernels themselves may still sum in a different
order from run to run (atomic additions in embedding, index and attention backwards), so
:func:`use_deterministic_algorithms` asks torch for deterministic kernels only.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch

from scaling.topology._topology import Topology

if TYPE_CHECKING:
    from scaling.config import StateDict

MODEL_PARALLEL_RNG = "model-parallel-rng"


def _get_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class RNGTracker:
    """Named RNG streams on one device that can be forked into the default generator.

    Example::

        tracker = RNGTracker(torch.device("cpu"))
        tracker.add("model-parallel-rng", seed=1234)
        with tracker.fork("model-parallel-rng"):
            x = torch.nn.functional.dropout(x, 0.1)   # draws from the named stream
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._states: dict[str, torch.Tensor] = {}

    def add(self, name: str, seed: int) -> None:
        """Create stream ``name`` seeded with ``seed``; re-adding a name is an error."""
        if name in self._states:
            raise ValueError(f"RNG stream {name!r} already exists; names: {sorted(self._states)}")
        self._states[name] = torch.Generator(self.device).manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Draw from stream ``name`` inside the block; the default stream is untouched."""
        if name not in self._states:
            raise KeyError(f"RNG stream {name!r} does not exist; known: {sorted(self._states)}")
        saved = _get_state(self.device)
        _set_state(self.device, self._states[name])
        try:
            yield
        finally:
            self._states[name] = _get_state(self.device)
            _set_state(self.device, saved)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self._states.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._states = {k: v.clone() for k, v in state.items()}


def seed_all(seed: int, topology: Topology) -> RNGTracker:
    """Seed every generator of this rank and return its tracker (see module docstring).

    ``topology.seed`` records ``seed``: layers built afterwards without a seed of their own
    (``ParallelModule``) initialise from it.
    """
    topology.seed = seed
    base = seed + 100 * topology.axis("pp").rank
    random.seed(base)
    np.random.seed(base % 2**32)
    torch.manual_seed(base)
    device = topology.device
    tracker = RNGTracker(device)
    tracker.add(MODEL_PARALLEL_RNG, seed + 2718 + topology.axis("tp").rank)
    return tracker


def get_rng_state(tracker: RNGTracker | None = None) -> StateDict:
    """Every RNG state of this process (python, numpy, torch CPU/CUDA, tracker streams)."""
    state: StateDict = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch_cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = torch.cuda.get_rng_state_all()
    if tracker is not None:
        state["tracker"] = tracker.state_dict()
    return state


def set_rng_state(state: StateDict, tracker: RNGTracker | None = None) -> None:
    """Restore what :func:`get_rng_state` captured."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch_cpu"])
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["torch_cuda"])
    if tracker is not None and "tracker" in state:
        tracker.load_state_dict(state["tracker"])


#: cuBLAS's workspace setting that makes its products deterministic (NVIDIA's cuBLAS docs, torch's).
CUBLAS_DETERMINISTIC = ":4096:8"


def use_deterministic_algorithms(enabled: bool = True) -> None:
    """The same run gives the same bits: torch's deterministic kernels only, as torchtitan's
    ``debug.deterministic`` and Megatron-LM's ``--deterministic-mode`` ask for.

    Enabled: ``torch.use_deterministic_algorithms(True)`` (an operator without a deterministic
    kernel on the device raises, naming itself), cuDNN deterministic and without autotuning,
    and ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` unless set (cuBLAS reads it at its first product,
    so call this before the first product on the GPU). It costs speed on GPUs; CPU kernels
    are deterministic already. Disabled: torch's defaults back (cuDNN autotuning stays off).
    """
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC)
        torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(enabled)
    torch.backends.cudnn.deterministic = enabled
