"""Seconds per step: a machine's profile, what its products and collectives cost, and a pipeline's
makespan from the schedule's own program.

A :class:`MachineProfile` holds what the step-time model reads about a machine: matrix-multiply
throughput by dtype and product size, memory bandwidth (element-wise operators), a fixed cost per
operator (Python, dispatch and kernel launch), how many ranks of a node compute at full speed at
once, and the links collectives use. It is a JSON file: measured on the machine by
``python -m scaling.trainer.planning profile`` (:func:`scaling.trainer.planning.measure_profile`),
or shipped (``profiles/*.json``: H100 and H200 nodes from their datasheets).

Collectives cost what a ring costs (NCCL's and gloo's large-message algorithm): an all-reduce of
``B`` bytes over ``n`` ranks moves ``2 (n - 1) / n * B`` per rank in ``2 (n - 1)`` steps, an
all-gather or reduce-scatter (``B`` the whole tensor) and an all-to-all half of that, a send ``B``
in one step; each step pays the link's latency.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from scaling.pipeline import SCHEDULES, placement_of, simulate

#: Where the shipped profiles are: ``<name>.json``.
PROFILES = Path(__file__).parent / "profiles"


@dataclass(frozen=True)
class Link:
    """A collective's cost on one kind of link: ``bandwidth`` bytes/s each rank sends (one
    direction) and ``latency`` seconds per step of the algorithm."""

    bandwidth: float
    latency: float


@dataclass(frozen=True)
class MachineProfile:
    """What the step-time model knows of a machine (see the module's docstring).

    Attributes:
        name, device: what it is (``device``: ``"cpu"`` or ``"cuda"``); ``source``: where its
            figures come from (a datasheet, or the command and date that measured them).
        devices_per_node: ranks that share a node (its fast link).
        compute_slots: ranks of a node that compute at full speed at once: a GPU node's devices;
            a CPU's cores over the threads each rank uses (more ranks share them).
        matmul: per dtype (``"fp32"``, ``"bf16"``, ``"fp8"``), ``(FLOPs of one product, FLOP/s)``
            points by ascending size; between two, the rate is interpolated on log scales, past the
            ends it is the end's.
        memory_bandwidth: bytes/s element-wise operators read and write.
        operator_overhead: seconds each operator costs besides its work (launch and dispatch).
        intra_node, inter_node: the links within a node and between nodes.
        collectives: measured links by ``(group size, ranks on the node)`` (a CPU's gloo, whose
            steps wait for crowded cores); where one is here it wins over ``intra_node``.
        overlap: whether communication runs beside computation (GPUs: NCCL's own streams; a CPU
            whose ranks already share its cores: no).
    """

    name: str
    device: str
    source: str
    devices_per_node: int
    compute_slots: int
    matmul: Mapping[str, Sequence[tuple[float, float]]]
    memory_bandwidth: float
    operator_overhead: float
    intra_node: Link
    inter_node: Link
    collectives: Mapping[tuple[int, int], Link] = field(default_factory=dict)
    overlap: bool = True

    def matmul_seconds(self, flops: float, dtype: str, count: int = 1) -> float:
        """Seconds for ``count`` products of ``flops`` FLOPs each in ``dtype`` (``fp32`` where the
        profile has no such dtype)."""
        if flops <= 0 or count <= 0:
            return 0.0
        points = self.matmul.get(dtype) or self.matmul["fp32"]
        sizes = [p[0] for p in points]
        if flops <= sizes[0]:
            rate = points[0][1]
        elif flops >= sizes[-1]:
            rate = points[-1][1]
        else:
            i = next(i for i, size in enumerate(sizes) if size >= flops)
            (f0, r0), (f1, r1) = points[i - 1], points[i]
            t = math.log(flops / f0) / math.log(f1 / f0)
            rate = math.exp(math.log(r0) + t * (math.log(r1) - math.log(r0)))
        return count * flops / rate

    def elementwise_seconds(self, nbytes: float, operators: float) -> float:
        """Seconds for ``operators`` element-wise operators that move ``nbytes`` in all."""
        return nbytes / self.memory_bandwidth + operators * self.operator_overhead

    def link(self, group_size: int, across_nodes: bool, ranks_on_node: int | None = None) -> Link:
        """The link a group of ``group_size`` ranks communicates over, ``ranks_on_node`` ranks
        sharing the node (default: the group's): the measured pair nearest to it, else the node's."""
        if across_nodes:
            return self.inter_node
        if not self.collectives:
            return self.intra_node
        key = (group_size, ranks_on_node or group_size)
        nearest = min(self.collectives, key=lambda k: (abs(k[0] - key[0]), abs(k[1] - key[1])))
        return self.collectives[nearest]

    def collective_seconds(
        self,
        kind: str,
        nbytes: float,
        group_size: int,
        across_nodes: bool = False,
        ranks_on_node: int | None = None,
    ) -> float:
        """Seconds a ring ``kind`` (``all_reduce``, ``all_gather``, ``reduce_scatter``,
        ``all_to_all``, ``send``) of ``nbytes`` (the whole tensor) takes on each of ``group_size``
        ranks (``ranks_on_node``: see :meth:`link`)."""
        if group_size <= 1 or nbytes <= 0:
            return 0.0
        link = self.link(group_size, across_nodes, ranks_on_node)
        n = group_size
        if kind == "send":
            return link.latency + nbytes / link.bandwidth
        steps = {"all_reduce": 2 * (n - 1), "all_gather": n - 1, "reduce_scatter": n - 1, "all_to_all": n - 1}
        if kind not in steps:
            raise ValueError(f"collective kind {kind!r} is unknown; choose one of {sorted([*steps, 'send'])}")
        return steps[kind] * (link.latency + nbytes / n / link.bandwidth)

    def to_json(self) -> str:
        data = asdict(self)
        data["collectives"] = {f"{n}/{ranks}": asdict(link) for (n, ranks), link in self.collectives.items()}
        data["matmul"] = {dtype: [list(p) for p in points] for dtype, points in self.matmul.items()}
        return json.dumps(data, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> MachineProfile:
        data = json.loads(text)
        data["intra_node"], data["inter_node"] = Link(**data["intra_node"]), Link(**data["inter_node"])
        data["collectives"] = {
            (int(key.split("/")[0]), int(key.split("/")[1])): Link(**link)
            for key, link in data.get("collectives", {}).items()
        }
        data["matmul"] = {dtype: tuple((float(f), float(r)) for f, r in pts) for dtype, pts in data["matmul"].items()}
        return cls(**data)

    @classmethod
    def load(cls, name_or_path: str | Path) -> MachineProfile:
        """A shipped profile by name (``h100-sxm-node``, ``h200-sxm-node``) or a profile file.

        Raises:
            ValueError: neither a shipped name nor a file; the message lists the shipped names.
        """
        path = Path(name_or_path)
        if not path.is_file():
            path = PROFILES / f"{name_or_path}.json"
        if not path.is_file():
            shipped = sorted(p.stem for p in PROFILES.glob("*.json"))
            raise ValueError(
                f"machine profile {str(name_or_path)!r} is neither a file nor a shipped profile ({', '.join(shipped)}); "
                "measure this machine's with `python -m scaling.trainer.planning profile --out FILE`"
            )
        return cls.from_json(path.read_text())


def spans_nodes(group_size: int, stride: int, devices_per_node: int) -> bool:
    """Whether a group of ``group_size`` ranks ``stride`` global ranks apart leaves one node
    (ranks fill nodes in order, ``devices_per_node`` each)."""
    return group_size > 1 and (group_size - 1) * stride + 1 > devices_per_node


def pipeline_seconds(
    schedule: str,
    num_stages: int,
    num_micro_batches: int,
    forward: float,
    backward: float,
    num_virtual_stages: int = 1,
    split: tuple[float, float] = (0.5, 0.5),
) -> float:
    """The makespan of ``schedule`` when each chunk's forward of one micro-batch takes ``forward``
    seconds and its backward ``backward``, from the schedule's own programs
    (``scaling.pipeline.simulate``; the transfers are in ``forward`` and ``backward``). A
    zero-bubble schedule's input and weight passes cost ``split`` times ``backward`` each. One
    stage: ``m * v * (forward + backward)``."""
    if num_stages == 1:
        return num_micro_batches * num_virtual_stages * (forward + backward)
    kwargs = {"num_virtual": num_virtual_stages} if num_virtual_stages > 1 else {}
    programs = [SCHEDULES[schedule](num_stages, num_micro_batches, s, **kwargs) for s in range(num_stages)]
    costs = {
        "forward": forward,
        "backward": backward,
        "backward_input": split[0] * backward,
        "backward_weight": split[1] * backward,
    }
    return simulate(programs, costs, placement=placement_of(SCHEDULES[schedule])).makespan
