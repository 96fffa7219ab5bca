"""Topology: rank <-> (pp, dp, cp, tp) coordinates, process groups and the DeviceMesh.

Rank order is TP fastest, then CP, then DP, then PP (Megatron-Core's order)::

    rank = ((pipe_parallel_rank * dp + data_parallel_rank) * cp + context_parallel_rank) * tp + model_parallel_rank

so a TP group is a run of consecutive ranks and lands on one node, and a CP group next.
Without context parallelism (cp = 1) this is the (pp, dp, tp) order of earlier versions.

The ranks that hold the same parameters are those of one (pp, tp) pair: the DP × CP
ranks. Gradients are averaged over them and ZeRO shards over them (Megatron-Core's
data-parallel group "with context parallel", torchtitan's ``dp_shard_cp``).

Every group is an axis of ``topology.axis(name)``, each defined once in ``_axes.py`` (with
the grid's arithmetic and group creation). What else has its own concept lives apart: RNG
(``_rng.py``), the rank's device (``_device.py``), teardown (``_teardown.py``), sequence
splits (``_sequence.py``), NCCL's flight recorder (``_flight_recorder.py``).
"""

from __future__ import annotations

import datetime
import os
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from scaling.topology._axes import AXIS_NAMES, Axis, AxisSpec, RankCoordinates, RankGrid, axis_specs, new_groups
from scaling.topology._compile_cache import name_compile_cache
from scaling.topology._config import TopologyConfig
from scaling.topology._device import local_device
from scaling.topology._flight_recorder import enable_flight_recorder
from scaling.topology._teardown import destroy_at_exit, destroy_process_group

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

MESH_DIM_NAMES = ("pp", "dp", "cp", "tp")


# The names of 0.1, one property per axis and quantity: each now reads an axis, warns, and goes
# in 0.2. ``_LEGACY_AXES`` maps a name's prefix to its axis.
_LEGACY_AXES = {
    "model_parallel": "tp",
    "data_parallel": "dp",
    "context_parallel": "cp",
    "pipe_parallel": "pp",
    "data_context_parallel": "dp_cp",
    "expert_parallel": "ep",
    "expert_data_parallel": "edp",
    "data_parallel_shard": "dp_shard",
    "data_parallel_replicate": "dp_replicate",
    "model_replica": "replica",
    "model_pipe_parallel": "replica",
}


class Topology:
    """The single source of truth for ranks, process groups and the device.

    Args:
        config: the validated topology config.
        global_rank: this process's rank in ``[0, world_size)``.
        local_rank: rank on this node (selects ``cuda:local_rank``); defaults to
            ``global_rank``.

    Each group is an axis: ``topology.axis("tp")`` has its size, this rank's place, its
    ranks and its group (see ``_axes.py`` for the derived axes). Process groups exist only
    after :meth:`initialize_distributed`; sizes, ranks and coordinates are plain arithmetic
    and available at once.
    """

    def __init__(self, config: TopologyConfig, global_rank: int, local_rank: int | None = None) -> None:
        ws = config.world_size
        assert ws is not None  # derived by TopologyConfig validation
        if not 0 <= global_rank < ws:
            raise ValueError(f"global_rank={global_rank} is outside [0, world_size={ws}); check RANK and world_size")
        self.config = config
        self.global_rank = global_rank
        self.local_rank = global_rank if local_rank is None else local_rank
        assert config.model_parallel_size and config.pipe_parallel_size and config.data_parallel_size
        self._grid = RankGrid(
            pp=config.pipe_parallel_size,
            dp=config.data_parallel_size,
            cp=config.context_parallel_size,
            tp=config.model_parallel_size,
            dp_shard=config.data_parallel_shard_size or config.data_parallel_size,
            ep=config.expert_parallel_size,
        )
        self._specs: dict[str, AxisSpec] = axis_specs(self._grid)
        self._axes: dict[str, Axis] = {}
        self._groups: dict[str, ProcessGroup] = {}
        self._mesh: DeviceMesh | None = None
        self._owns_default_group = False
        #: The run's seed, as given to :func:`seed_all` (None before): what model
        #: initialisation derives its per-layer seeds from when not given one.
        self.seed: int | None = None

    # ----------------------------------------------------------- construction
    @classmethod
    def from_env(cls, config: TopologyConfig, environ: Mapping[str, str] | None = None) -> Topology:
        """Build from the torchrun variables ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``.

        Raises:
            ValueError: when a variable is missing or ``WORLD_SIZE`` disagrees with the config.
        """
        env = os.environ if environ is None else environ
        missing = [k for k in ("RANK", "WORLD_SIZE") if k not in env]
        if missing:
            raise ValueError(
                f"Topology.from_env: {missing} not set; launch with torchrun or scaling-run, "
                "which set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT"
            )
        world_size = int(env["WORLD_SIZE"])
        if world_size != config.world_size:
            raise ValueError(
                f"WORLD_SIZE={world_size} from the launcher does not match topology world_size="
                f"{config.world_size} (model_parallel_size={config.model_parallel_size} × "
                f"context_parallel_size={config.context_parallel_size} × pipe_parallel_size={config.pipe_parallel_size} × data_parallel_size="
                f"{config.data_parallel_size}); launch {config.world_size} processes or change the topology"
            )
        return cls(config, int(env["RANK"]), int(env.get("LOCAL_RANK", env["RANK"])))

    # ------------------------------------------------------------- the axes
    @property
    def world_size(self) -> int:
        return self._grid.world_size

    def axis(self, name: str) -> Axis:
        """The named axis as this rank sees it: ``"pp"``, ``"dp"``, ``"cp"``, ``"tp"`` (the mesh
        dimensions) or a derived one (``"dp_cp"``, ``"ep"``, ``"edp"``, ``"dp_shard"``,
        ``"dp_replicate"``, ``"replica"``, ``"pp_result"``; see ``_axes.py``)."""
        if name not in self._axes:
            if name not in self._specs:
                raise ValueError(f"no axis {name!r}; the axes are {', '.join(AXIS_NAMES)}")
            spec = self._specs[name]
            ranks = spec.ranks_of(self.global_rank)
            key = spec.group
            self._axes[name] = Axis(
                name=name,
                size=len(ranks),
                rank=ranks.index(self.global_rank),
                ranks=ranks,
                mesh_dim=name if name in MESH_DIM_NAMES else None,
                _group=(lambda: None) if key is None else (lambda: self._group(key, name)),
            )
        return self._axes[name]

    def coordinates(self, rank: int | None = None) -> RankCoordinates:
        """The (pp, dp, cp, tp) coordinates of ``rank`` (default: this rank)."""
        return self._grid.coordinates(self.global_rank if rank is None else rank)

    def rank_of(self, pp: int, dp: int, tp: int, cp: int = 0) -> int:
        """The global rank at coordinates (pp, dp, cp, tp)."""
        return self._grid.rank_of(pp, dp, tp, cp)

    def stage_rank_lists(self, stages: list[int]) -> list[list[int]]:
        """For every pipe (each (dp, cp, tp)), the global ranks of ``stages`` in it, in a fixed order.

        For groups over some stages of each pipe (tied weights): every rank creates every group.
        """
        g = self._grid
        return [[g.rank_of(s, d, t, c) for s in stages] for d in range(g.dp) for c in range(g.cp) for t in range(g.tp)]

    # ------------------------------------------------------------- device
    @property
    def device(self) -> torch.device:
        """``cuda:local_rank`` or cpu, as :func:`~scaling.topology._device.local_device` resolves it."""
        return local_device(self.config, self.local_rank)

    @property
    def backend(self) -> str:
        if self.config.backend != "auto":
            return self.config.backend
        return "nccl" if self.device.type == "cuda" else "gloo"

    @property
    def timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.config.timeout_seconds)

    def __repr__(self) -> str:
        c = self.config
        return (
            f"Topology(rank={self.global_rank}/{self.world_size} {self.coordinates()!r}, "
            f"tp={c.model_parallel_size}, pp={c.pipe_parallel_size}, dp={c.data_parallel_size}, "
            + (f"cp={c.context_parallel_size}, " if c.context_parallel_size > 1 else "")
            + f"device={self.config.device}, backend={self.config.backend})"
        )

    # ------------------------------------------------------ process groups
    def initialize_distributed(self, init_method: str | None = None) -> Topology:
        """Create the default process group (unless one exists) and every axis's group.

        Every rank must call this collectively. With an existing default group (for
        example from a test harness) only the subgroups and the mesh are created. On NCCL
        torch's flight recorder is turned on first (``flight_recorder_entries``; see
        ``_flight_recorder.py``).

        Args:
            init_method: rendezvous URL; default ``env://`` (MASTER_ADDR/MASTER_PORT).
        """
        name_compile_cache()
        enable_flight_recorder(self.backend, self.config.flight_recorder_entries)  # before any NCCL group
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if not dist.is_initialized():
            dist.init_process_group(
                backend=self.backend,
                init_method=init_method or "env://",
                rank=self.global_rank,
                world_size=self.world_size,
                timeout=self.timeout,
            )
            self._owns_default_group = True
            destroy_at_exit()
        elif dist.get_world_size() != self.world_size or dist.get_rank() != self.global_rank:
            raise ValueError(
                f"existing process group has rank {dist.get_rank()} of {dist.get_world_size()}, but the "
                f"topology expects rank {self.global_rank} of {self.world_size}"
            )
        # Every group with the configured timeout, then wrapped as a mesh.
        self._groups.update(new_groups(self._specs, self.world_size, self.global_rank, self.timeout))
        g = self._grid
        self._mesh = DeviceMesh.from_group(
            [self._groups[name] for name in MESH_DIM_NAMES],
            self.device.type,
            mesh=torch.arange(self.world_size).view(g.pp, g.dp, g.cp, g.tp),
            mesh_dim_names=MESH_DIM_NAMES,
        )
        return self

    def _group(self, key: str, axis: str) -> ProcessGroup:
        if key not in self._groups:
            raise RuntimeError(
                f'the group of axis("{axis}") does not exist yet; call topology.initialize_distributed() on every '
                "rank first"
            )
        return self._groups[key]

    @property
    def is_distributed_initialized(self) -> bool:
        return bool(self._groups)

    @property
    def device_mesh(self) -> DeviceMesh:
        """DeviceMesh with dims ``("pp", "dp", "cp", "tp")``."""
        if self._mesh is None:
            raise RuntimeError(
                "device_mesh does not exist yet; call topology.initialize_distributed() on every rank first"
            )
        return self._mesh

    def destroy(self) -> None:
        """Forget the subgroups; destroy the default group if this topology created it."""
        self._groups.clear()
        self._mesh = None
        if self._owns_default_group:
            destroy_process_group()
            self._owns_default_group = False

    if not TYPE_CHECKING:  # the names of 0.1 at run time only: type-checked code uses the axes

        def __getattr__(self, name: str) -> object:
            return _legacy(self, name)


_LEGACY_OTHER: dict[str, tuple[str, Callable[[Topology], object]]] = {
    "pipe_parallel_result_group": ('axis("pp_result").group', lambda t: t.axis("pp_result").group),
    "is_first_pipe_stage": ('axis("pp").is_first', lambda t: t.axis("pp").is_first),
    "is_last_pipe_stage": ('axis("pp").is_last', lambda t: t.axis("pp").is_last),
    "previous_pipe_rank": ('axis("pp").previous', lambda t: t.axis("pp").previous),
    "next_pipe_rank": ('axis("pp").next', lambda t: t.axis("pp").next),
    "pipe_rank_of_stage": ('axis("pp").ranks[stage]', lambda t: lambda stage: t.axis("pp").ranks[stage]),
    # HSDP's count of DP ranks per shard group (the dp_shard axis has their CP ranks too)
    "data_parallel_shard_size": (
        "config.data_parallel_shard_size",
        lambda t: t.config.data_parallel_shard_size or t.config.data_parallel_size,
    ),
}


def _legacy(topology: Topology, name: str) -> object:
    """A name of 0.1 (``model_parallel_group``, ``is_first_pipe_stage``, ...): its value from the
    axes, with a DeprecationWarning naming the replacement (Python's filters show it once per place)."""
    if name in _LEGACY_OTHER:
        new, value = _LEGACY_OTHER[name]
        result = value(topology)
    else:
        prefix, _, quantity = name.rpartition("_")
        if prefix.endswith("_ranks") and quantity == "of":  # data_context_parallel_ranks_of(rank)
            prefix, quantity = prefix.removesuffix("_ranks"), "ranks_of"
        if prefix not in _LEGACY_AXES or quantity not in ("size", "rank", "ranks", "group", "ranks_of"):
            raise AttributeError(f"'Topology' object has no attribute {name!r}")
        axis = _LEGACY_AXES[prefix]
        if quantity == "ranks_of":
            new = f'axis("{axis}") (ranks of another rank: Topology.coordinates and rank_of)'
            spec = topology._specs[axis]
            result = spec.ranks_of
        else:
            new = f'axis("{axis}").{quantity}'
            result = getattr(topology.axis(axis), quantity)
    warnings.warn(f"Topology.{name} is deprecated; use topology.{new}", DeprecationWarning, stacklevel=3)
    return result
