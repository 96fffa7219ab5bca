"""Thin wrappers over ``torch.distributed`` that every Scaling package uses.

Each collective takes its process group explicitly; ``None`` or a group of one rank
makes it the identity (no communication). Every call goes through the recorder (a
ring append and a counter: microseconds), in debug mode through a cross-rank check
first, and a failure (timeout, closed connection) is turned into an error that names
the group, the op and the ranks that diverged or did not arrive.

The blocking wrappers (``all_reduce``, ``all_gather``, ``reduce_scatter``,
``broadcast``) inline their path instead of going through :func:`_collective`: the
calling thread wakes from the previous collective with cold caches, so every Python
call, object and lookup on the way costs several times its warm price (see the
collectives section of ``docs/benchmarks.md``). Group size and rank come from the
recorder's per-group state, not from torch, and no handle is built for a blocking call.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from scaling.collectives import _compat, _diagnosis, _p2p_diagnosis
from scaling.collectives._recorder import CollectiveRecord, _GroupState, get_recorder
from scaling.topology import barrier_device_ids

ProcessGroup = dist.ProcessGroup
_RECORDER = get_recorder()
_group_state = _RECORDER._group_state
_record_one = _RECORDER._record_one
_add_wait = _RECORDER.add_wait
_clock = time.perf_counter


def group_size(group: ProcessGroup | None) -> int:
    """Number of ranks in ``group``; 1 for ``None`` (the identity group).

    Under ``torch.compile`` this module runs eagerly (``scaling.nn``'s compile helpers skip it),
    so the size is a value the compiled code guards on. ``dist.get_world_size(group)`` traced
    instead is folded into the graph with a guard on the group's type only: a graph compiled for
    one group then runs for another of a different size (a second trainer in the process)."""
    return 1 if group is None else group.size()


def group_rank(group: ProcessGroup | None) -> int:
    """This rank's index inside ``group``; 0 for ``None`` (see :func:`group_size` under compile)."""
    return 0 if group is None else group.rank()


def group_device(group: ProcessGroup | None) -> torch.device | None:
    """The device ``group`` communicates on: ``cpu`` for gloo, the current CUDA device for NCCL.

    ``None`` for ``None`` (the identity group) and for other or mixed backends, where the
    caller's tensors decide.
    """
    if group is None:
        return None
    kind = _group_state(group).device_type
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return None if kind is None else torch.device(kind)


def _check_divisible(x: torch.Tensor, dim: int, world: int, what: str) -> int:
    size = x.shape[dim]
    if size % world != 0:
        raise ValueError(
            f"{what}: tensor of shape {list(x.shape)} has size {size} in dim={dim}, which is not divisible "
            f"by the group size {world}; pad dim {dim} to a multiple of {world} or use a group whose size divides it"
        )
    return size // world


class PendingCollective:
    """A collective issued with ``async_op``: :meth:`wait` is bounded and diagnosed like a blocking call.

    The call is recorded (and, in debug mode, cross-checked) when it is issued, so a
    rank that hangs in an overlapped gradient reduction is named the same way as one
    that hangs in a blocking collective.
    """

    __slots__ = ("_group", "_rec", "_state", "_then", "_work")

    def __init__(
        self,
        work: object | None,
        group: ProcessGroup | None,
        state: object,
        rec: object,
        then: Callable[[], object] | None = None,
    ) -> None:
        self._work, self._group, self._state, self._rec, self._then = work, group, state, rec, then

    def wait(self) -> None:
        """Block until the collective is done (a no-op after the first call).

        Raises:
            CollectiveMismatchError: ranks called different collectives (named).
            CollectiveTimeoutError: a rank did not arrive within the group timeout (named).
        """
        work, self._work = self._work, None
        if work is None:
            return
        start = _clock()
        try:
            work.wait()  # type: ignore[attr-defined]
        except RuntimeError as exc:
            raise _diagnosis.diagnose_failure(self._group, self._state, self._rec, exc) from exc  # type: ignore[arg-type]
        _add_wait(self._rec.op, _clock() - start)  # type: ignore[attr-defined]
        if self._then is not None:
            self._then()


# Tag of the pair exchanges below: apart from tag 0, which PipeTransport and plain send/recv use.
_PAIR_TAG = 0x5CA1E


class _PairWork:
    """The send and the receive of one exchange with the peer of a two-rank group, waited as one."""

    __slots__ = ("_recv", "_send")

    def __init__(self, send: dist.Work, recv: dist.Work) -> None:
        self._send, self._recv = send, recv

    def wait(self) -> bool:
        self._recv.wait()
        return bool(self._send.wait())


def _pair_exchange(group: ProcessGroup, peer: int, outgoing: torch.Tensor, incoming: torch.Tensor) -> _PairWork:
    """Post ``outgoing`` to and ``incoming`` from group rank ``peer`` together (c10d point-to-point)."""
    return _PairWork(group.send([outgoing], peer, _PAIR_TAG), group.recv([incoming], peer, _PAIR_TAG))


def _begin(
    group: ProcessGroup, state: _GroupState, op: str, tensor: torch.Tensor, peer: int | None = None
) -> CollectiveRecord:
    """Record a blocking call of one tensor (and, in debug mode, cross-check it) before it is issued."""
    rec = _record_one(state, op, tensor, peer)
    if _RECORDER.debug:
        _diagnosis.pre_check(group, state, rec)
    return rec


def _collective(
    op: str,
    group: ProcessGroup,
    tensors: tuple[torch.Tensor, ...],
    run: Callable[[], object],
    peer: int | None = None,
    async_op: bool = False,
    then: Callable[[], object] | None = None,
) -> PendingCollective:
    if len(tensors) > 1:
        state, rec = _RECORDER.record(op, group, tensors, peer)
    else:
        state = _group_state(group)
        rec = _record_one(state, op, tensors[0] if tensors else None, peer)
    if _RECORDER.debug:
        _diagnosis.pre_check(group, state, rec)
    start = _clock()
    try:
        work = run()
    except RuntimeError as exc:  # gloo/NCCL timeouts and transport errors (DistError is a RuntimeError)
        raise _diagnosis.diagnose_failure(group, state, rec, exc) from exc
    _add_wait(op, _clock() - start)  # a blocking call's whole wait; an async one's issue
    return PendingCollective(work if async_op else None, group, state, rec, then)


def all_reduce_async(
    tensor: torch.Tensor, group: ProcessGroup | None, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
) -> PendingCollective:
    """Start an in-place all-reduce of ``tensor`` over ``group``; wait on the returned handle.

    The overlapped form of :func:`all_reduce` (what a DDP-style reducer issues from
    backward hooks). It is recorded when issued; ``handle.wait()`` raises the same
    named errors as :func:`all_reduce`. ``None`` or one rank returns a done handle.
    """
    if group is None or _group_state(group).size == 1:
        return PendingCollective(None, group, None, None)
    return _collective(
        "all_reduce",
        group,
        (tensor,),
        lambda: dist.all_reduce(tensor, op=op, group=group, async_op=True),
        async_op=True,
    )


def reduce_scatter_async(
    output: torch.Tensor,
    tensor: torch.Tensor,
    group: ProcessGroup | None,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
) -> PendingCollective:
    """Start a reduce-scatter of the flat ``tensor`` into ``output`` (this rank's equal chunk).

    ``tensor`` is 1-D with ``group_size * output.numel()`` elements; shard ``i`` goes to
    group rank ``i``. ``None`` or one rank copies ``tensor`` into ``output`` and returns a
    done handle. Waiting raises the same named errors as :func:`reduce_scatter`.

    ``tensor`` is scratch: its contents are unspecified afterwards. On gloo a
    two-rank sum is one exchange with the peer (its chunk out, the peer's contribution to
    ours in, c10d point-to-point) and an add on ``wait()``; larger groups and other ops run
    an in-place all-reduce of ``tensor`` and copy this rank's chunk on ``wait()``. Both
    beat gloo's own reduce-scatter (4 MiB on 2 ranks here: exchange 2.3 ms, all-reduce
    4.7 ms, reduce-scatter 8.5 ms) and give the same sum (two addends: bitwise).

    Raises:
        ValueError: when the sizes do not match.
    """
    state = None if group is None else _group_state(group)
    world = 1 if state is None else state.size
    if tensor.dim() != 1 or output.dim() != 1 or tensor.numel() != world * output.numel():
        raise ValueError(
            f"reduce_scatter_async: input of shape {list(tensor.shape)} and output of shape {list(output.shape)} "
            f"do not fit a group of {world}; pass a 1-D input of group_size * output.numel() elements"
        )
    if world == 1:
        output.copy_(tensor)
        return PendingCollective(None, group, None, None)
    assert group is not None and state is not None
    if state.device_type == "cpu":  # gloo: the exchange and all-reduce paths below beat its reduce-scatter
        chunk = tensor.view(world, -1)[state.rank]
        if world == 2 and op == dist.ReduceOp.SUM:
            peer = 1 - state.rank
            incoming = torch.empty_like(output)
            return _collective(
                "reduce_scatter",
                group,
                (tensor,),
                lambda: _pair_exchange(group, peer, tensor.view(world, -1)[peer], incoming),
                async_op=True,
                then=lambda: torch.add(chunk, incoming, out=output),
            )
        return _collective(
            "reduce_scatter",
            group,
            (tensor,),
            lambda: dist.all_reduce(tensor, op=op, group=group, async_op=True),
            async_op=True,
            then=lambda: output.copy_(chunk),
        )
    return _collective(
        "reduce_scatter",
        group,
        (tensor,),
        lambda: _compat.reduce_scatter_single(output, tensor, op=op, group=group, async_op=True),
        async_op=True,
    )


def all_reduce(
    tensor: torch.Tensor, group: ProcessGroup | None, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
) -> torch.Tensor:
    """All-reduce ``tensor`` in place over ``group`` and return it.

    Args:
        tensor: reduced in place.
        group: the process group; ``None`` or one rank returns ``tensor`` untouched.
        op: the reduction (``SUM`` by default; average explicitly by dividing after).

    Raises:
        CollectiveMismatchError: ranks called different collectives (named).
        CollectiveTimeoutError: a rank did not arrive within the group timeout (named).
    """
    if group is None:
        return tensor
    state = _group_state(group)
    if state.size == 1:
        return tensor
    rec = _begin(group, state, "all_reduce", tensor)
    start = _clock()
    try:
        dist.all_reduce(tensor, op=op, group=group)
    except RuntimeError as exc:  # gloo/NCCL timeouts and transport errors (DistError is a RuntimeError)
        raise _diagnosis.diagnose_failure(group, state, rec, exc) from exc
    _add_wait("all_reduce", _clock() - start)
    return tensor


def all_gather(tensor: torch.Tensor, group: ProcessGroup | None, dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along ``dim`` in group-rank order (a new tensor).

    Every rank must pass the same shape. ``None`` or one rank returns ``tensor``.
    """
    if group is None:
        return tensor
    state = _group_state(group)
    world = state.size
    if world == 1:
        return tensor
    if dim != 0:
        dim = dim % tensor.dim()
    moved = tensor.contiguous() if dim == 0 else tensor.movedim(dim, 0).contiguous()
    shape = moved.shape
    out = moved.new_empty((world * shape[0], *shape[1:]))
    rec = _begin(group, state, "all_gather", tensor)
    start = _clock()
    try:
        _compat.all_gather_single(out, moved, group=group)
    except RuntimeError as exc:
        raise _diagnosis.diagnose_failure(group, state, rec, exc) from exc
    _add_wait("all_gather", _clock() - start)
    return out if dim == 0 else out.movedim(0, dim).contiguous()


def reduce_scatter(
    tensor: torch.Tensor, group: ProcessGroup | None, dim: int = 0, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
) -> torch.Tensor:
    """Reduce ``tensor`` over ``group`` and return this rank's equal chunk along ``dim``.

    Raises:
        ValueError: when ``tensor.shape[dim]`` is not divisible by the group size.
    """
    if group is None:
        return tensor
    state = _group_state(group)
    world = state.size
    if world == 1:
        return tensor
    dim = dim % tensor.dim()
    _check_divisible(tensor, dim, world, "reduce_scatter")
    moved = tensor.contiguous() if dim == 0 else tensor.movedim(dim, 0).contiguous()
    shape = moved.shape
    out = moved.new_empty((shape[0] // world, *shape[1:]))
    rec = _begin(group, state, "reduce_scatter", tensor)
    start = _clock()
    try:
        _compat.reduce_scatter_single(out, moved, op=op, group=group)
    except RuntimeError as exc:
        raise _diagnosis.diagnose_failure(group, state, rec, exc) from exc
    _add_wait("reduce_scatter", _clock() - start)
    return out if dim == 0 else out.movedim(0, dim).contiguous()


def split(tensor: torch.Tensor, group: ProcessGroup | None, dim: int = -1) -> torch.Tensor:
    """This rank's equal chunk of ``tensor`` along ``dim`` (no communication), contiguous."""
    if group is None:
        return tensor
    state = _group_state(group)
    world = state.size
    if world == 1:
        return tensor
    dim = dim % tensor.dim()
    _check_divisible(tensor, dim, world, "split")
    return tensor.chunk(world, dim=dim)[state.rank].contiguous()


def broadcast(tensor: torch.Tensor, src: int, group: ProcessGroup | None) -> torch.Tensor:
    """Broadcast ``tensor`` in place from global rank ``src`` to every rank of ``group``."""
    if group is None:
        return tensor
    state = _group_state(group)
    if state.size == 1:
        return tensor
    rec = _begin(group, state, "broadcast", tensor, src)
    start = _clock()
    try:
        dist.broadcast(tensor, src=src, group=group)
    except RuntimeError as exc:
        raise _diagnosis.diagnose_failure(group, state, rec, exc) from exc
    _add_wait("broadcast", _clock() - start)
    return tensor


def broadcast_async(tensor: torch.Tensor, src: int, group: ProcessGroup | None) -> PendingCollective:
    """Start an in-place broadcast of ``tensor`` from global rank ``src``; wait on the returned handle.

    A receiver may post it long before ``src`` does (the pipeline's first stages post
    the step-result broadcast early in a step, so it has arrived when they finish).
    ``None`` or one rank returns a done handle; waiting raises the named errors of
    :func:`broadcast`.
    """
    if group is None or _group_state(group).size == 1:
        return PendingCollective(None, group, None, None)
    return _collective(
        "broadcast",
        group,
        (tensor,),
        lambda: dist.broadcast(tensor, src=src, group=group, async_op=True),
        src,
        async_op=True,
    )


def broadcast_object(obj: object, src: int, group: ProcessGroup | None, device: torch.device | None = None) -> object:
    """Broadcast a picklable object from global rank ``src``; returns it on every rank.

    The pickled bytes travel on ``device``, by default the group's own (:func:`group_device`):
    a CUDA device on NCCL, which takes no CPU tensor.
    """
    if group_size(group) == 1:
        return obj
    assert group is not None
    if device is None:
        device = group_device(group)
    box = [obj]
    _collective(
        "broadcast_object", group, (), lambda: dist.broadcast_object_list(box, src=src, group=group, device=device), src
    )
    return box[0]


def barrier(group: ProcessGroup | None) -> None:
    """Block until every rank of ``group`` arrives."""
    if group_size(group) == 1:
        return
    assert group is not None
    ids = barrier_device_ids(group)  # NCCL's device named, not guessed from the global rank
    _collective("barrier", group, (), lambda: dist.barrier(group=group, device_ids=ids))


def batch_send_recv(ops: Sequence[tuple[str, torch.Tensor, int]], group: ProcessGroup | None = None) -> None:
    """Post every ``("send" | "recv", tensor, peer)`` at once and wait for all of them.

    The ops go through ``torch.distributed.batch_isend_irecv``, so two ranks that send
    to each other in the same call cannot deadlock. Peers are global ranks.

    Raises:
        ValueError: on an op other than ``"send"``/``"recv"``.
        CollectiveTimeoutError: a transfer did not complete in time; names the peers and,
            from their reports, whether each never posted the matching call or posted it
            with another shape (``missing_ranks`` / ``divergent_ranks``).
    """
    if not ops:
        return
    for kind, _, peer in ops:
        if kind not in ("send", "recv"):
            raise ValueError(f"batch_send_recv: op {kind!r} (peer {peer}) is not one of 'send', 'recv'")
    recs = _RECORDER._record_p2p(ops)
    p2p_ops = [dist.P2POp(dist.isend if kind == "send" else dist.irecv, t, peer, group) for kind, t, peer in ops]
    start = _clock()
    try:
        for work in dist.batch_isend_irecv(p2p_ops):
            work.wait()
    except RuntimeError as exc:
        raise _p2p_diagnosis.p2p_failure(recs, group, exc) from exc
    _add_wait("send_recv", _clock() - start)


def send(tensor: torch.Tensor, dst: int, group: ProcessGroup | None = None) -> None:
    """Send ``tensor`` to global rank ``dst`` (blocking until the transfer is done)."""
    batch_send_recv([("send", tensor, dst)], group)


def recv(tensor: torch.Tensor, src: int, group: ProcessGroup | None = None) -> torch.Tensor:
    """Receive into ``tensor`` from global rank ``src``; returns ``tensor``."""
    batch_send_recv([("recv", tensor, src)], group)
    return tensor


def all_gather_async(output: torch.Tensor, tensor: torch.Tensor, group: ProcessGroup | None) -> PendingCollective:
    """Start gathering every rank's flat ``tensor`` into ``output`` in group-rank order.

    The overlapped form of :func:`all_gather` for flat buffers (a ZeRO optimizer gathers
    updated shards with it, bucket by bucket, while it updates the next bucket).
    ``output`` is 1-D with ``group_size * tensor.numel()`` elements; rank ``i``'s
    ``tensor`` lands in ``output[i * n : (i + 1) * n]``. ``tensor`` may be this rank's own slice of
    ``output`` (the in-place form, as NCCL defines it); it must not overlap ``output``
    otherwise. The call is recorded (op ``"all_gather"``) when issued; waiting raises
    the same named errors as :func:`all_gather`. ``None`` or one rank copies ``tensor``
    into ``output`` and returns a done handle. On gloo a two-rank gather is one
    exchange with the peer (c10d point-to-point, straight into ``output``), twice as fast
    as gloo's all-gather here; the values are the same.

    Raises:
        ValueError: when the sizes, dtypes or devices do not match.
    """
    world = group_size(group)
    if (
        tensor.dim() != 1
        or output.dim() != 1
        or output.numel() != world * tensor.numel()
        or output.dtype != tensor.dtype
        or output.device != tensor.device
    ):
        raise ValueError(
            f"all_gather_async: input of shape {list(tensor.shape)} ({tensor.dtype}, {tensor.device}) and output of "
            f"shape {list(output.shape)} ({output.dtype}, {output.device}) do not fit a group of {world}; pass a 1-D "
            "output of group_size * input.numel() elements with the input's dtype and device"
        )
    if world == 1:
        output.copy_(tensor)
        return PendingCollective(None, group, None, None)
    assert group is not None
    if world == 2 and _group_state(group).device_type == "cpu":
        # Two ranks on gloo: one exchange with the peer, straight into the output (4 MiB
        # here: 2.2 ms against 4.4 ms for gloo's all-gather).
        rank = _group_state(group).rank
        rows = output.view(2, -1)
        if rows[rank].data_ptr() != tensor.data_ptr():
            rows[rank].copy_(tensor)
        return _collective(
            "all_gather",
            group,
            (tensor,),
            lambda: _pair_exchange(group, 1 - rank, tensor, rows[1 - rank]),
            async_op=True,
        )
    return _collective(
        "all_gather",
        group,
        (tensor,),
        lambda: _compat.all_gather_single(output, tensor, group=group, async_op=True),
        async_op=True,
    )
