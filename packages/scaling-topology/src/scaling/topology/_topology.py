"""Topology: rank <-> (pp, dp, cp, tp) coordinates, process groups and the DeviceMesh.

Rank order is TP fastest, then CP, then DP, then PP (Megatron-Core's order)::

    rank = ((pipe_parallel_rank * dp + data_parallel_rank) * cp + context_parallel_rank) * tp + model_parallel_rank

so a TP group is a run of consecutive ranks and lands on one node, and a CP group next.
Without context parallelism (cp = 1) this is the (pp, dp, tp) order of earlier versions.

The ranks that hold the same parameters are those of one (pp, tp) pair: the DP × CP
ranks. Gradients are averaged over them and ZeRO shards over them (Megatron-Core's
data-parallel group "with context parallel", torchtitan's ``dp_shard_cp``).

What has its own concept lives apart: group construction (``_groups.py``), RNG
(``_rng.py``), the rank's device (``_device.py``), teardown (``_teardown.py``), sequence
splits (``_sequence.py``), NCCL's flight recorder (``_flight_recorder.py``), the deprecated
names (``_deprecated.py``).
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from scaling.topology._compile_cache import name_compile_cache
from scaling.topology._config import TopologyConfig
from scaling.topology._deprecated import DeprecatedNames
from scaling.topology._device import local_device
from scaling.topology._flight_recorder import enable_flight_recorder
from scaling.topology._groups import new_groups
from scaling.topology._teardown import destroy_at_exit, destroy_process_group

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

MESH_DIM_NAMES = ("pp", "dp", "cp", "tp")


@dataclass(frozen=True)
class RankCoordinates:
    """Where one rank sits in the (pp, dp, cp, tp) grid."""

    pp: int
    dp: int
    tp: int
    cp: int = 0

    def __repr__(self) -> str:
        cp = f", cp={self.cp}" if self.cp else ""
        return f"(pp={self.pp}, dp={self.dp}{cp}, tp={self.tp})"


class Topology(DeprecatedNames):
    """The single source of truth for ranks, process groups and the device.

    Args:
        config: the validated topology config.
        global_rank: this process's rank in ``[0, world_size)``.
        local_rank: rank on this node (selects ``cuda:local_rank``); defaults to
            ``global_rank``.

    Process groups exist only after :meth:`initialize_distributed`; coordinates and
    rank lists are plain arithmetic and available at once.
    """

    def __init__(self, config: TopologyConfig, global_rank: int, local_rank: int | None = None) -> None:
        ws = config.world_size
        assert ws is not None  # derived by TopologyConfig validation
        if not 0 <= global_rank < ws:
            raise ValueError(f"global_rank={global_rank} is outside [0, world_size={ws}); check RANK and world_size")
        self.config = config
        self.global_rank = global_rank
        self.local_rank = global_rank if local_rank is None else local_rank
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

    # ------------------------------------------------------------- arithmetic
    @property
    def world_size(self) -> int:
        return self.config.world_size  # type: ignore[return-value]

    @property
    def model_parallel_size(self) -> int:
        return self.config.model_parallel_size  # type: ignore[return-value]

    @property
    def pipe_parallel_size(self) -> int:
        return self.config.pipe_parallel_size  # type: ignore[return-value]

    @property
    def data_parallel_size(self) -> int:
        return self.config.data_parallel_size  # type: ignore[return-value]

    @property
    def context_parallel_size(self) -> int:
        return self.config.context_parallel_size

    @property
    def data_context_parallel_size(self) -> int:
        """Ranks that hold the same parameters: DP × CP (gradients are averaged over them)."""
        return self.data_parallel_size * self.context_parallel_size

    @property
    def expert_parallel_size(self) -> int:
        """DP ranks that split the experts of a mixture-of-experts layer between them."""
        return self.config.expert_parallel_size

    @property
    def expert_parallel_rank(self) -> int:
        """Which part of the experts this rank holds: ``dp % expert_parallel_size``."""
        return self.data_parallel_rank % self.expert_parallel_size

    @property
    def expert_data_parallel_size(self) -> int:
        """Ranks holding the same experts (DP × CP / EP): expert gradients are reduced over them."""
        return self.data_context_parallel_size // self.expert_parallel_size

    @property
    def expert_data_parallel_rank(self) -> int:
        """This rank's place among the ranks holding the same experts (its ZeRO shard index for them)."""
        return (self.data_parallel_rank // self.expert_parallel_size) * self.context_parallel_size + (
            self.context_parallel_rank
        )

    @property
    def data_parallel_shard_size(self) -> int:
        """DP ranks that shard among themselves (HSDP); ``data_parallel_size`` without HSDP.

        The ZeRO shard group is these DP ranks times the CP ranks of each.
        """
        return self.config.data_parallel_shard_size or self.data_parallel_size

    @property
    def data_parallel_replicate_size(self) -> int:
        """Replicas of each shard group (HSDP); 1 without HSDP."""
        return self.data_parallel_size // self.data_parallel_shard_size

    @property
    def data_parallel_shard_rank(self) -> int:
        """This rank's place in its shard group (its ZeRO shard index, over DP × CP)."""
        return (self.data_parallel_rank % self.data_parallel_shard_size) * self.context_parallel_size + (
            self.context_parallel_rank
        )

    @property
    def data_parallel_replicate_rank(self) -> int:
        """Which shard group (replica) this rank is in."""
        return self.data_parallel_rank // self.data_parallel_shard_size

    def coordinates(self, rank: int | None = None) -> RankCoordinates:
        """The (pp, dp, cp, tp) coordinates of ``rank`` (default: this rank)."""
        r = self.global_rank if rank is None else rank
        tp, cp, dp = self.model_parallel_size, self.context_parallel_size, self.data_parallel_size
        return RankCoordinates(pp=r // (dp * cp * tp), dp=(r // (cp * tp)) % dp, tp=r % tp, cp=(r // tp) % cp)

    def rank_of(self, pp: int, dp: int, tp: int, cp: int = 0) -> int:
        """The global rank at coordinates (pp, dp, cp, tp)."""
        return ((pp * self.data_parallel_size + dp) * self.context_parallel_size + cp) * self.model_parallel_size + tp

    @property
    def model_parallel_rank(self) -> int:
        return self.coordinates().tp

    @property
    def data_parallel_rank(self) -> int:
        return self.coordinates().dp

    @property
    def pipe_parallel_rank(self) -> int:
        return self.coordinates().pp

    @property
    def context_parallel_rank(self) -> int:
        return self.coordinates().cp

    @property
    def data_context_parallel_rank(self) -> int:
        """This rank's place among the DP × CP ranks of its (pp, tp): ``dp * cp_size + cp``."""
        c = self.coordinates()
        return c.dp * self.context_parallel_size + c.cp

    @property
    def model_parallel_ranks(self) -> list[int]:
        """Global ranks of this rank's TP group, in TP order."""
        return self._ranks_along(self.global_rank, "tp")

    @property
    def data_parallel_ranks(self) -> list[int]:
        return self._ranks_along(self.global_rank, "dp")

    @property
    def context_parallel_ranks(self) -> list[int]:
        """Global ranks of this rank's CP group (one sequence's slices), in CP order."""
        return self._ranks_along(self.global_rank, "cp")

    @property
    def data_context_parallel_ranks(self) -> list[int]:
        """Global ranks holding the same parameters as this rank (DP × CP), in (dp, cp) order."""
        return self.data_context_parallel_ranks_of(self.global_rank)

    def data_context_parallel_ranks_of(self, rank: int) -> list[int]:
        """The DP × CP ranks of ``rank``'s (pp, tp), in (dp, cp) order."""
        c = self.coordinates(rank)
        return [
            self.rank_of(c.pp, d, c.tp, k)
            for d in range(self.data_parallel_size)
            for k in range(self.context_parallel_size)
        ]

    @property
    def pipe_parallel_ranks(self) -> list[int]:
        return self._ranks_along(self.global_rank, "pp")

    @property
    def model_replica_ranks(self) -> list[int]:
        """Global ranks holding one full model replica (TP × PP at this DP and CP rank)."""
        c = self.coordinates()
        return [
            self.rank_of(p, c.dp, t, c.cp)
            for p in range(self.pipe_parallel_size)
            for t in range(self.model_parallel_size)
        ]

    @property
    def is_first_pipe_stage(self) -> bool:
        return self.pipe_parallel_rank == 0

    @property
    def is_last_pipe_stage(self) -> bool:
        return self.pipe_parallel_rank == self.pipe_parallel_size - 1

    def pipe_rank_of_stage(self, stage: int) -> int:
        """Global rank of pipeline stage ``stage`` in this rank's pipe (same dp, cp, tp)."""
        c = self.coordinates()
        return self.rank_of(stage, c.dp, c.tp, c.cp)

    def stage_rank_lists(self, stages: list[int]) -> list[list[int]]:
        """For every pipe (each (dp, cp, tp)), the global ranks of ``stages`` in it, in a fixed order.

        For groups over some stages of each pipe (tied weights): every rank creates every group.
        """
        return [
            [self.rank_of(s, d, t, c) for s in stages]
            for d in range(self.data_parallel_size)
            for c in range(self.context_parallel_size)
            for t in range(self.model_parallel_size)
        ]

    @property
    def previous_pipe_rank(self) -> int | None:
        """Global rank of the previous stage, None on the first stage."""
        p = self.pipe_parallel_rank
        return None if p == 0 else self.pipe_rank_of_stage(p - 1)

    @property
    def next_pipe_rank(self) -> int | None:
        """Global rank of the next stage, None on the last stage."""
        p = self.pipe_parallel_rank
        return None if p == self.pipe_parallel_size - 1 else self.pipe_rank_of_stage(p + 1)

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
        """Create the default process group (unless one exists) and every subgroup.

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
        self._groups.update(new_groups(self, self.global_rank, self.timeout))
        shape = (self.pipe_parallel_size, self.data_parallel_size, self.context_parallel_size, self.model_parallel_size)
        self._mesh = DeviceMesh.from_group(
            [self._groups[name] for name in MESH_DIM_NAMES],
            self.device.type,
            mesh=torch.arange(self.world_size).view(shape),
            mesh_dim_names=MESH_DIM_NAMES,
        )
        return self

    def _ranks_along(self, rank: int, axis: str) -> list[int]:
        """Global ranks that share every coordinate of ``rank`` except ``axis``."""
        c = self.coordinates(rank)
        sizes = {
            "pp": self.pipe_parallel_size,
            "dp": self.data_parallel_size,
            "cp": self.context_parallel_size,
            "tp": self.model_parallel_size,
        }
        coords = {"pp": c.pp, "dp": c.dp, "cp": c.cp, "tp": c.tp}
        return [self.rank_of(**{**coords, axis: i}) for i in range(sizes[axis])]

    def _dp_ranks_where(self, rank: int, key: Callable[[int, int], object]) -> list[int]:
        """The DP × CP ranks at ``rank``'s (pp, tp) whose (dp, cp) coordinates have the same ``key`` as its own."""
        c = self.coordinates(rank)
        mine = key(c.dp, c.cp)
        return [
            r
            for r in self.data_context_parallel_ranks_of(rank)
            if key(self.coordinates(r).dp, self.coordinates(r).cp) == mine
        ]

    def _group(self, key: str, name: str) -> ProcessGroup:
        if key not in self._groups:
            raise RuntimeError(f"{name} does not exist yet; call topology.initialize_distributed() on every rank first")
        return self._groups[key]

    @property
    def is_distributed_initialized(self) -> bool:
        return bool(self._groups)

    @property
    def model_parallel_group(self) -> ProcessGroup:
        """The TP group."""
        return self._group("tp", "model_parallel_group")

    @property
    def data_parallel_group(self) -> ProcessGroup:
        return self._group("dp", "data_parallel_group")

    @property
    def context_parallel_group(self) -> ProcessGroup:
        """The CP group: the ranks holding slices of the same sequences."""
        return self._group("cp", "context_parallel_group")

    @property
    def data_context_parallel_group(self) -> ProcessGroup:
        """DP × CP: the ranks that hold the same parameters (gradient averaging, ZeRO).

        The DP group without context parallelism, the CP group without data parallelism.
        """
        if self.context_parallel_size == 1:
            return self.data_parallel_group
        if self.data_parallel_size == 1:
            return self.context_parallel_group
        return self._group("dp_cp", "data_context_parallel_group")

    @property
    def expert_parallel_group(self) -> ProcessGroup | None:
        """The consecutive DP ranks (same CP rank) whose experts together make a layer's; None without EP."""
        return None if self.expert_parallel_size == 1 else self._group("ep", "expert_parallel_group")

    @property
    def expert_data_parallel_group(self) -> ProcessGroup | None:
        """The ranks holding the same experts (DP × CP / EP); None when that is this rank alone."""
        if self.expert_parallel_size == 1:
            return self.data_context_parallel_group
        if self.expert_data_parallel_size == 1:
            return None
        return self._group("edp", "expert_data_parallel_group")

    @property
    def data_parallel_shard_group(self) -> ProcessGroup | None:
        """The ranks that shard among themselves (ZeRO): DP × CP without HSDP; under HSDP
        ``data_parallel_shard_size`` DP ranks with their CP ranks; None (no communication)
        when that is one rank."""
        if self.data_parallel_shard_size == self.data_parallel_size:
            return self.data_context_parallel_group
        if self.data_parallel_shard_size * self.context_parallel_size == 1:
            return None
        if self.data_parallel_shard_size == 1:
            return self.context_parallel_group
        return self._group("dp_shard", "data_parallel_shard_group")

    @property
    def data_parallel_replicate_group(self) -> ProcessGroup | None:
        """The replicas of this rank's shard (HSDP; same CP rank): None (no communication) without HSDP."""
        if self.data_parallel_shard_size == self.data_parallel_size:
            return None
        if self.data_parallel_shard_size == 1:
            return self.data_parallel_group
        return self._group("dp_replicate", "data_parallel_replicate_group")

    @property
    def pipe_parallel_group(self) -> ProcessGroup:
        return self._group("pp", "pipe_parallel_group")

    @property
    def pipe_parallel_result_group(self) -> ProcessGroup:
        """A second group over the ranks of :attr:`pipe_parallel_group`.

        For a collective posted early and completed late (the pipeline's step results:
        the other stages post their receive early in a step), so that it never
        interleaves with the pipe group's own traffic: activations and gradients, or
        tied-weight reductions, which must keep their order on every rank. Equal to
        :attr:`pipe_parallel_group` without pipeline parallelism.
        """
        if "pp_result" in self._groups:
            return self._groups["pp_result"]
        return self.pipe_parallel_group

    @property
    def model_replica_group(self) -> ProcessGroup:
        """TP × PP ranks holding one model replica, at this DP and CP rank (global gradient norms,
        model-wide reductions)."""
        return self._group("mp", "model_replica_group")

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
