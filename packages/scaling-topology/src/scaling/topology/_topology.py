"""Topology: rank <-> (pp, dp, tp) coordinates, process groups and the DeviceMesh.

Rank order is TP fastest, then DP, then PP::

    rank = pipe_parallel_rank * (dp * tp) + data_parallel_rank * tp + model_parallel_rank

so a TP group is a run of consecutive ranks and lands on one node.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from scaling.topology._config import TopologyConfig

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

MESH_DIM_NAMES = ("pp", "dp", "tp")
# How long destroy_process_group() lets go of the GIL before destroying the groups.
_GLOO_SETTLE_SECONDS = 0.01


def destroy_process_group() -> None:
    """Destroy the default process group and every subgroup, if one is initialised.

    ``torch.distributed.destroy_process_group`` after a short pause: on torch 2.6 gloo can
    deadlock there. A gloo thread, holding its work mutex, frees a finished collective
    whose tensors need the GIL to drop their Python objects, while the caller holds the
    GIL and waits for that mutex in ``~ProcessGroupGloo`` (seen under load: ranks hung at
    the end of a run). Letting go of the GIL for 10 ms lets such a thread finish first.
    This narrows the race; it does not close it. Upstream, pytorch/pytorch#154976 (merged
    June 2025) releases the GIL in the process group's destructor; the suite has not hung
    there on torch 2.10 or newer.
    """
    if dist.is_initialized():
        time.sleep(_GLOO_SETTLE_SECONDS)
        dist.destroy_process_group()


@dataclass(frozen=True)
class RankCoordinates:
    """Where one rank sits in the (pp, dp, tp) grid."""

    pp: int
    dp: int
    tp: int

    def __repr__(self) -> str:
        return f"(pp={self.pp}, dp={self.dp}, tp={self.tp})"


class Topology:
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
                f"pipe_parallel_size={config.pipe_parallel_size} × data_parallel_size="
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
    def data_parallel_shard_size(self) -> int:
        """DP ranks that shard among themselves (HSDP); ``data_parallel_size`` without HSDP."""
        return self.config.data_parallel_shard_size or self.data_parallel_size

    @property
    def data_parallel_replicate_size(self) -> int:
        """Replicas of each shard group (HSDP); 1 without HSDP."""
        return self.data_parallel_size // self.data_parallel_shard_size

    @property
    def data_parallel_shard_rank(self) -> int:
        """This rank's place in its shard group (its ZeRO shard index)."""
        return self.data_parallel_rank % self.data_parallel_shard_size

    @property
    def data_parallel_replicate_rank(self) -> int:
        """Which shard group (replica) this rank is in."""
        return self.data_parallel_rank // self.data_parallel_shard_size

    def coordinates(self, rank: int | None = None) -> RankCoordinates:
        """The (pp, dp, tp) coordinates of ``rank`` (default: this rank)."""
        r = self.global_rank if rank is None else rank
        tp, dp = self.model_parallel_size, self.data_parallel_size
        return RankCoordinates(pp=r // (dp * tp), dp=(r // tp) % dp, tp=r % tp)

    def rank_of(self, pp: int, dp: int, tp: int) -> int:
        """The global rank at coordinates (pp, dp, tp)."""
        return pp * self.data_parallel_size * self.model_parallel_size + dp * self.model_parallel_size + tp

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
    def model_parallel_ranks(self) -> list[int]:
        """Global ranks of this rank's TP group, in TP order."""
        c = self.coordinates()
        return [self.rank_of(c.pp, c.dp, t) for t in range(self.model_parallel_size)]

    @property
    def data_parallel_ranks(self) -> list[int]:
        c = self.coordinates()
        return [self.rank_of(c.pp, d, c.tp) for d in range(self.data_parallel_size)]

    @property
    def pipe_parallel_ranks(self) -> list[int]:
        c = self.coordinates()
        return [self.rank_of(p, c.dp, c.tp) for p in range(self.pipe_parallel_size)]

    @property
    def model_pipe_parallel_ranks(self) -> list[int]:
        """Global ranks holding one full model replica (TP × PP at this DP rank)."""
        c = self.coordinates()
        return [
            self.rank_of(p, c.dp, t) for p in range(self.pipe_parallel_size) for t in range(self.model_parallel_size)
        ]

    @property
    def is_first_pipe_stage(self) -> bool:
        return self.pipe_parallel_rank == 0

    @property
    def is_last_pipe_stage(self) -> bool:
        return self.pipe_parallel_rank == self.pipe_parallel_size - 1

    @property
    def previous_pipe_rank(self) -> int | None:
        """Global rank of the previous stage, None on the first stage."""
        c = self.coordinates()
        return None if c.pp == 0 else self.rank_of(c.pp - 1, c.dp, c.tp)

    @property
    def next_pipe_rank(self) -> int | None:
        """Global rank of the next stage, None on the last stage."""
        c = self.coordinates()
        return None if c.pp == self.pipe_parallel_size - 1 else self.rank_of(c.pp + 1, c.dp, c.tp)

    # ------------------------------------------------------------- device
    @property
    def device(self) -> torch.device:
        """``cuda:local_rank`` for device cuda (or auto with CUDA present and no gloo backend), else cpu."""
        want = self.config.device
        if want == "cuda" or (want == "auto" and self.config.backend != "gloo" and torch.cuda.is_available()):
            if not torch.cuda.is_available():
                raise RuntimeError("topology device='cuda' but torch.cuda.is_available() is False; use device='cpu'")
            return torch.device("cuda", self.local_rank % max(torch.cuda.device_count(), 1))
        return torch.device("cpu")

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
            f"device={self.config.device}, backend={self.config.backend})"
        )

    # ------------------------------------------------------ process groups
    def initialize_distributed(self, init_method: str | None = None) -> Topology:
        """Create the default process group (unless one exists) and every subgroup.

        Every rank must call this collectively. With an existing default group (for
        example from a test harness) only the subgroups and the mesh are created.

        Args:
            init_method: rendezvous URL; default ``env://`` (MASTER_ADDR/MASTER_PORT).
        """
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
        elif dist.get_world_size() != self.world_size or dist.get_rank() != self.global_rank:
            raise ValueError(
                f"existing process group has rank {dist.get_rank()} of {dist.get_world_size()}, but the "
                f"topology expects rank {self.global_rank} of {self.world_size}"
            )
        # Every group is created here with the configured timeout (init_device_mesh would
        # create the per-dim groups with torch's 30-minute default), then wrapped as a mesh.
        # new_group is collective over the default group: every rank creates every group in
        # the same order and keeps the ones it belongs to.
        shard = self.data_parallel_shard_size
        for name, ranks_of in (
            ("pp", lambda r: self._ranks_along(r, "pp")),
            ("dp", lambda r: self._ranks_along(r, "dp")),
            ("tp", lambda r: self._ranks_along(r, "tp")),
            ("mp", lambda r: [x for x in range(self.world_size) if self.coordinates(x).dp == self.coordinates(r).dp]),
            # A second pipe group (see pipe_parallel_result_group), only where a pipe has two ranks or more.
            *([("pp_result", lambda r: self._ranks_along(r, "pp"))] if self.pipe_parallel_size > 1 else []),
            # HSDP: consecutive DP ranks shard, and the groups replicate (only where both exceed 1).
            *(
                [
                    ("dp_shard", lambda r: self._dp_ranks_where(r, lambda d: d // shard)),
                    ("dp_replicate", lambda r: self._dp_ranks_where(r, lambda d: d % shard)),
                ]
                if 1 < self.data_parallel_shard_size < self.data_parallel_size
                else []
            ),
        ):
            seen: set[tuple[int, ...]] = set()
            for r in range(self.world_size):
                ranks = tuple(ranks_of(r))
                if ranks in seen:
                    continue
                seen.add(ranks)
                group = dist.new_group(list(ranks), timeout=self.timeout, group_desc=name)
                if self.global_rank in ranks:
                    self._groups[name] = group
        shape = (self.pipe_parallel_size, self.data_parallel_size, self.model_parallel_size)
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
        sizes = {"pp": self.pipe_parallel_size, "dp": self.data_parallel_size, "tp": self.model_parallel_size}
        coords = {"pp": c.pp, "dp": c.dp, "tp": c.tp}
        return [self.rank_of(**{**coords, axis: i}) for i in range(sizes[axis])]

    def _dp_ranks_where(self, rank: int, key: Callable[[int], int]) -> list[int]:
        """The DP ranks at ``rank``'s (pp, tp) whose DP coordinate has the same ``key`` as its own."""
        mine = key(self.coordinates(rank).dp)
        return [r for r in self._ranks_along(rank, "dp") if key(self.coordinates(r).dp) == mine]

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
    def data_parallel_shard_group(self) -> ProcessGroup | None:
        """The DP ranks that shard among themselves: the DP group without HSDP; None (no
        communication) when ``data_parallel_shard_size`` is 1."""
        if self.data_parallel_shard_size == self.data_parallel_size:
            return self.data_parallel_group
        if self.data_parallel_shard_size == 1:
            return None
        return self._group("dp_shard", "data_parallel_shard_group")

    @property
    def data_parallel_replicate_group(self) -> ProcessGroup | None:
        """The replicas of this rank's shard (HSDP): None (no communication) without HSDP."""
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
    def model_pipe_parallel_group(self) -> ProcessGroup:
        """TP × PP ranks of this DP replica (global gradient norms, model-wide reductions)."""
        return self._group("mp", "model_pipe_parallel_group")

    @property
    def device_mesh(self) -> DeviceMesh:
        """DeviceMesh with dims ``("pp", "dp", "tp")``."""
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
