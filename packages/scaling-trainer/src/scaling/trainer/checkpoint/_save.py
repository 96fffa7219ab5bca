"""save_checkpoint: DCP shards, JSON metadata, per-rank state, then the commit marker."""

from __future__ import annotations

import json
import threading
import warnings
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar, cast

import torch
import torch.distributed as dist
from safetensors.torch import save as safetensors_bytes

# The defining submodule: mypy sees the package __init__'s names as not re-exported.
from torch.distributed.checkpoint import staging as dcp_staging
from torch.distributed.checkpoint import state_dict_saver as dcp_saver
from torch.distributed.tensor import DTensor

from scaling.topology import barrier_device_ids
from scaling.trainer.checkpoint import _marker as mk
from scaling.trainer.checkpoint._hashing_writer import Digest, HashingFileSystemWriter, write_file_hashed
from scaling.trainer.checkpoint._tree import encode_pytree, flatten_state

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from scaling.config import JsonDict, StateDict
    from scaling.topology import Topology

EXTRA_FILE = "extra.json"
SCALARS_FILE = "scalars.json"
# DCP writer threads (and shard files) per rank for large writes: each thread hashes what it
# writes, so two threads hash two files at once; the loader verifies them in parallel too.
_WRITE_THREADS = 2
_SPLIT_BYTES = 16 << 20
# Newer torch stages an async save through DefaultStager, which copies every tensor into its
# own CPU buffer before async_save returns. torch 2.6 has no default stager: it only moves
# tensors to the CPU, so a CPU tensor stays shared with the caller and an update made right
# after the call would change what is written. There we copy before handing the tensors over.
_ASYNC_SAVE_COPIES = hasattr(dcp_staging, "DefaultStager")


@contextmanager
def without_single_process_warning() -> Iterator[None]:
    """DCP warns on every save or load without a process group, even when told so (``no_dist``):
    import-hf, generate and export-hf work in one process on purpose."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled, )?unavailable or uninitialized")
        yield


def rank_file(rank: int, suffix: str) -> str:
    return f"ranks/rank_{rank:05d}.{suffix}"


T = TypeVar("T")


def _world(pg: ProcessGroup | None) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(), dist.get_world_size(pg)


def _all_gather(obj: T, pg: ProcessGroup | None, world: int) -> list[T]:
    if world == 1:
        return [obj]
    out: list[object] = [None] * world
    dist.all_gather_object(out, obj, group=pg)
    return cast("list[T]", out)  # every rank sent a T


def _barrier(pg: ProcessGroup | None, world: int) -> None:
    if world > 1:
        dist.barrier(group=pg, device_ids=barrier_device_ids(pg))


class PendingSave:
    """Handle of a (possibly asynchronous) save; :meth:`wait` returns the committed folder."""

    def __init__(self, path: Path, thread: threading.Thread | None = None) -> None:
        self.path = path
        self._thread = thread
        self.error: BaseException | None = None

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> Path:
        """Block until the checkpoint is committed on every rank; re-raise a failure."""
        if self._thread is not None:
            self._thread.join()
        if self.error is not None:
            raise self.error
        return self.path


class StagingBuffers:
    """CPU copies of the state that asynchronous saves reuse, instead of allocating their own.

    An asynchronous save copies every tensor before it returns, so training can change the
    originals while the files are written. Fresh buffers for each save cost the page faults
    of the whole state (0.1-0.15 s per 256 MiB on the 2-core dev VM); these stay allocated
    for the next save, like DCP's ``cache_staged_state_dict`` (which needs pinned memory,
    hence a GPU) and torchtitan's pinned-memory staging. The price is host memory for one
    copy of this rank's state between saves (page-locked for CUDA state). A buffer is made
    anew when its (local) tensor's shape or dtype changes. As for every save, wait for the
    previous one before starting the next (it may still be writing from these buffers).
    Tensors and DTensors on CPU meshes are staged here, and CUDA tensors into pinned host
    buffers by non-blocking copies, waited for once before the save returns (DCP's default
    staging copies them into fresh pageable memory, a slower copy that faults every page
    again); a state holding a DTensor on another device keeps DCP's own staging.

    Example::

        >>> staging = StagingBuffers()
        >>> pending = save_checkpoint(path, step, state, topology, async_save=True,
        ...                           process_group=group, staging=staging)
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    @staticmethod
    def can_stage(tensors: Mapping[str, torch.Tensor]) -> bool:
        """Whether every value is a CPU or CUDA tensor, or a DTensor on a CPU mesh."""
        return all(
            v.device_mesh.device_type == "cpu" if isinstance(v, DTensor) else v.device.type in ("cpu", "cuda")
            for v in tensors.values()
        )

    def stage(self, tensors: Mapping[str, torch.Tensor]) -> StateDict:
        """``tensors`` copied into the kept buffers (a DTensor keeps its mesh, placements and global shape)."""
        staged: StateDict = {}
        devices: set[torch.device] = set()
        for key, value in tensors.items():
            local = value.to_local() if isinstance(value, DTensor) else value
            cuda = local.device.type == "cuda"
            buffer = self._buffers.get(key)
            if (
                buffer is None
                or buffer.shape != local.shape
                or buffer.dtype != local.dtype
                or buffer.is_pinned() != cuda
            ):
                buffer = self._buffers[key] = torch.empty(local.shape, dtype=local.dtype, pin_memory=cuda)
            buffer.copy_(local.detach(), non_blocking=cuda)
            if cuda:
                devices.add(local.device)
            if isinstance(value, DTensor):
                staged[key] = DTensor.from_local(
                    buffer,
                    value.device_mesh,
                    value.placements,
                    run_check=False,
                    shape=value.shape,
                    stride=value.stride(),
                )
            else:
                staged[key] = buffer
        for device in devices:  # the copies out of device memory have landed: the caller may train on
            torch.cuda.current_stream(device).synchronize()
        for key in self._buffers.keys() - tensors.keys():
            del self._buffers[key]
        return staged


def _layout(topology: Topology | None) -> dict[str, int]:
    if topology is None:
        return {"pp": 1, "dp": 1, "tp": 1, "world_size": 1}
    return {
        "pp": topology.axis("pp").size,
        "dp": topology.axis("dp").size,
        "tp": topology.axis("tp").size,
        "world_size": topology.world_size,
    }


def _merge_scalars(per_rank: list[StateDict]) -> tuple[StateDict, list[str]]:
    merged: StateDict = {}
    conflicting: set[str] = set()
    for scalars in per_rank:
        for k, v in scalars.items():
            if k in merged and merged[k] != v:
                conflicting.add(k)
            merged.setdefault(k, v)
    return {k: v for k, v in merged.items() if k not in conflicting}, sorted(conflicting)


def _trusted(step_dir: Path, known: dict[str, Digest]) -> dict[str, Digest]:
    """The digests of ``known`` whose file is still there with the size that was hashed."""
    out = {}
    for name, digest in known.items():
        try:
            size = (step_dir / name).stat().st_size
        except FileNotFoundError:
            continue
        if size == digest["size"]:
            out[name] = digest
    return out


def _hash_missing(step_dir: Path, files: dict[str, Digest], names: list[str]) -> None:
    todo = [n for n in names if n not in files]
    files.update(zip(todo, mk.hash_files([step_dir / n for n in todo])))


def _commit(
    save_dir: Path,
    step_dir: Path,
    step: int,
    info: JsonDict,
    pg: ProcessGroup | None,
    keep_last: int | None,
    known: dict[str, Digest],
) -> None:
    rank, world = _world(pg)
    # Every rank hashed what it wrote while writing it (``known``); a file of this rank
    # without a digest is hashed from disk here, and rank 0 does the same for any other
    # file in the folder, so the marker always covers every file.
    mine = _trusted(step_dir, known)
    own = [n for n in mk.list_files(step_dir) if n.startswith(f"__{rank}_") or n.startswith(rank_file(rank, ""))]
    _hash_missing(step_dir, mine, own)
    gathered = _all_gather(mine, pg, world)
    if rank == 0:
        files: JsonDict = {}
        for part in gathered:
            files.update(part)
        names = mk.list_files(step_dir)
        _hash_missing(step_dir, files, names)
        mk.write_marker(step_dir, step, {n: files[n] for n in names}, info)
        mk.write_latest(save_dir, step)
        if keep_last is not None:
            mk.prune(save_dir, keep_last, step)
    _barrier(pg, world)


def save_checkpoint(
    save_dir: str | Path,
    step: int,
    state: Mapping[str, object],
    topology: Topology | None,
    *,
    extra: Mapping[str, object] | None = None,
    rank_state: StateDict | None = None,
    keep_last: int | None = None,
    async_save: bool = False,
    process_group: ProcessGroup | None = None,
    staging: StagingBuffers | None = None,
) -> PendingSave:
    """Save a checkpoint of every rank's ``state`` into ``save_dir/step_{step:08d}``.

    Collective over ``process_group`` (default: the world). Tensors and DTensors of
    ``state`` go to DCP shards; its scalar leaves, ``extra`` (rank 0's) and each rank's
    ``rank_state`` (e.g. RNG states) go to JSON and safetensors files; nothing is
    pickled. Then every rank hashes its files and rank 0 writes ``commit.json`` and
    replaces ``latest``; a folder without ``commit.json`` is never loaded and is deleted
    by the next save.

    Args:
        save_dir: the checkpoint root folder.
        step: optimizer step, names the folder (``>= 0``).
        state: ``{"model": model_state_dict(...), "optimizer": optimizer.state_dict(), ...}``.
        topology: the topology (``None`` in one process without a process group).
        extra: JSON-able metadata (counters, config dict, data-loader state).
        rank_state: this rank's own state (``get_rng_state(tracker)``): tensors,
            numpy arrays, tuples, lists, str-keyed dicts and scalars.
        keep_last: keep only the newest N committed checkpoints (``None`` = all).
        async_save: stage tensors to CPU (``dcp.async_save``), then write and commit in
            a background thread. Needs ``process_group`` distinct from the training
            collectives when running distributed (see :func:`new_checkpoint_group`).
        process_group: the group the save's collectives run on.
        staging: with ``async_save``, copy the tensors into these kept buffers instead of
            new ones (see :class:`StagingBuffers`; the trainer keeps one).

    Returns:
        A :class:`PendingSave`; call ``wait()`` before the next save and before exit.

    Raises:
        ValueError: a bad ``step``/``keep_last``, or ``async_save`` without a group.
        TypeError: ``extra`` is not JSON-able, or ``state`` holds an unsupported type.
    """
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step={step!r} must be an int >= 0")
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last={keep_last!r} must be >= 1 or None (keep all)")
    rank, world = _world(process_group)
    if async_save and world > 1 and process_group is None:
        raise ValueError(
            "async_save=True needs process_group: a group used only by checkpointing (create it once with "
            "new_checkpoint_group()), so background collectives never interleave with training ones"
        )
    try:
        extra_json = json.dumps(dict(extra or {}), sort_keys=True)
    except TypeError as e:
        raise TypeError(f"extra must be JSON-able (counters, config dict, loader state): {e}") from e
    tensors, scalars = flatten_state(state)
    rank_tensors: StateDict = {}
    rank_json = {"rank_state": encode_pytree(rank_state, rank_tensors), "scalars": scalars}

    save_dir = Path(save_dir)
    step_dir = save_dir / mk.step_dir_name(step)
    mk.check_step_dir(step_dir)
    if (step_dir / mk.MARKER).exists():
        raise ValueError(f"{step_dir} is already a committed checkpoint; save under a new step or delete it first")
    if rank == 0:
        save_dir.mkdir(parents=True, exist_ok=True)
        mk.remove_uncommitted(save_dir)
        (step_dir / "ranks").mkdir(parents=True)
    merged, conflicting = _merge_scalars(_all_gather(scalars, process_group, world))  # also a barrier
    side: dict[str, Digest] = {}
    side_files: dict[str, str | bytes] = {rank_file(rank, "json"): json.dumps(rank_json, sort_keys=True)}
    if rank_tensors:
        side_files[rank_file(rank, "safetensors")] = safetensors_bytes(rank_tensors)
    if rank == 0:
        side_files[EXTRA_FILE] = extra_json
        side_files[SCALARS_FILE] = json.dumps({"values": merged, "per_rank_only": conflicting})
    for name, data in side_files.items():
        side[name] = write_file_hashed(step_dir / name, data)
    info = {"layout": _layout(topology), "world_size": world}
    writer = HashingFileSystemWriter(step_dir, max_threads=_WRITE_THREADS, split_bytes=_SPLIT_BYTES)
    if not async_save:
        with without_single_process_warning():
            dcp_saver.save(tensors, storage_writer=writer, process_group=process_group)
        _commit(save_dir, step_dir, step, info, process_group, keep_last, {**side, **writer.digests(step_dir)})
        return PendingSave(step_dir)

    if staging is not None and staging.can_stage(tensors):
        tensors = staging.stage(tensors)
        writer.staged = True  # DCP's own staging would copy them again
    elif not _ASYNC_SAVE_COPIES:
        tensors = {key: value.detach().clone() for key, value in tensors.items()}
    response = dcp_saver.async_save(tensors, storage_writer=writer, process_group=process_group)
    # Without an async stager DCP returns a plain Future; an AsyncSaveResponse (newer torch) wraps one.
    upload = response if isinstance(response, Future) else response.upload_completion
    pending = PendingSave(step_dir)

    def finish() -> None:
        try:
            upload.result()
            _commit(save_dir, step_dir, step, info, process_group, keep_last, {**side, **writer.digests(step_dir)})
        except BaseException as e:  # noqa: BLE001 - re-raised by wait() in the caller's thread
            pending.error = e

    pending._thread = threading.Thread(target=finish, name=f"checkpoint-commit-{step}", daemon=True)
    pending._thread.start()
    return pending


def new_checkpoint_group() -> ProcessGroup | None:
    """A gloo group over all ranks for checkpoint collectives (collective; create once)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.new_group(backend="gloo")
