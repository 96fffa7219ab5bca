"""BaseContext: the topology, the config and the counters of one training run."""

from __future__ import annotations

from typing import TYPE_CHECKING, Generic, TypeVar

from scaling.config import BaseConfig
from scaling.topology import (
    RNGTracker,
    Topology,
    seed_all,
    use_deterministic_algorithms,
)
from scaling.trainer._config import TrainerConfig

if TYPE_CHECKING:
    from scaling.config import StateDict

ConfigT = TypeVar("ConfigT", bound=BaseConfig)


class BaseContext(Generic[ConfigT]):
    """Holds what every component of a run shares.

    Args:
        config: the app's whole config.
        topology: this rank's topology (process groups are created by :meth:`initialize`).

    Attributes:
        iterations: optimizer steps done so far.
        consumed_samples: training samples consumed so far (over all DP ranks).
        rng_tracker: the TP-aware RNG streams, after :meth:`initialize`.

    Example::

        context = BaseContext(config=config, topology=Topology.from_env(config.topology))
        context.initialize(seed=config.trainer.seed)
    """

    def __init__(self, config: ConfigT, topology: Topology) -> None:
        self.config = config
        self.topology = topology
        self.iterations = 0
        self.consumed_samples = 0
        self.rng_tracker: RNGTracker | None = None

    def initialize(self, seed: int, init_method: str | None = None) -> None:
        """Create the process groups (collectively) and seed every generator of this rank.

        With ``trainer.deterministic`` in the config, torch's deterministic kernels are chosen
        here, before the model is built (cuBLAS reads its setting at its first product; the
        trainer chooses them too, for a context without that section).
        """
        trainer = getattr(self.config, "trainer", None)
        if isinstance(trainer, TrainerConfig) and trainer.deterministic:
            use_deterministic_algorithms()
        if not self.topology.is_distributed_initialized:
            self.topology.initialize_distributed(init_method=init_method)
        self.rng_tracker = seed_all(seed, self.topology)

    def step(self) -> None:
        """Count one optimizer step of ``global_batch_size`` samples."""
        self.iterations += 1
        gbs = self.topology.config.global_batch_size
        self.consumed_samples += 0 if gbs is None else gbs

    def state_dict(self) -> StateDict:
        """Counters (JSON-able); RNG states are saved per rank by the checkpointer."""
        return {"iterations": self.iterations, "consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: StateDict) -> None:
        self.iterations = int(state["iterations"])
        self.consumed_samples = int(state["consumed_samples"])
