"""Files hashed while they are written, so a save never reads its own bytes back.

The commit marker needs the sha256 of every file. Re-reading the shards after DCP wrote
them costs a full extra pass over the checkpoint; instead every byte is fed to sha256 as
it goes to the file (``hashlib`` takes the writer's memoryviews without a copy and
releases the GIL, so DCP's writer threads hash in parallel). A stream that was seeked
(rewritten in place) has no trustworthy running digest: it is left out, and the commit
hashes that file from disk like any other file it has no digest for.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

# The defining submodule: mypy sees the package __init__'s names as not re-exported.
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from scaling.config import JsonDict, StateDict

Digest = JsonDict


class _HashingStream:
    """A binary file whose bytes are hashed on their way to the file."""

    def __init__(self, raw: IO[bytes]) -> None:
        self.raw = raw
        self.digest = hashlib.sha256()
        self.size = 0
        self.seeked = False

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data)
        self.digest.update(view)
        self.size += view.nbytes
        return int(self.raw.write(view))

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self.seeked = True
        return int(self.raw.seek(offset, whence))

    def tell(self) -> int:
        return int(self.raw.tell())

    def fileno(self) -> int:
        return int(self.raw.fileno())

    def flush(self) -> None:
        self.raw.flush()

    def close(self) -> None:
        self.raw.close()

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return bool(self.raw.seekable())

    def readable(self) -> bool:
        return False

    @property
    def closed(self) -> bool:
        return bool(self.raw.closed)


class HashingFileSystem(FileSystem):
    """DCP's local file system, recording ``{size, sha256}`` of every file it writes."""

    def __init__(self) -> None:
        super().__init__()
        self.digests: dict[Path, Digest] = {}
        self._lock = threading.Lock()

    # Any: the stream yielded is torch's IOBase or a _HashingStream, which has only the
    # methods DCP's writer calls (write, seek, tell) and is not an IOBase.
    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        if "w" not in mode or "+" in mode:
            with super().create_stream(path, mode) as plain:
                yield plain
            return
        path = Path(path)
        with path.open(mode) as raw:
            stream = _HashingStream(raw)
            yield stream
        with self._lock:
            if stream.seeked:
                self.digests.pop(path, None)
            else:
                self.digests[path] = {"size": stream.size, "sha256": stream.digest.hexdigest()}

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        super().rename(path, new_path)
        with self._lock:
            digest = self.digests.pop(Path(path), None)
            if digest is not None:
                self.digests[Path(new_path)] = digest


class HashingFileSystemWriter(FileSystemWriter):
    """A ``FileSystemWriter`` that hashes its shards and ``.metadata`` while writing them.

    Args:
        path: the step folder.
        max_threads: writer threads (and shard files) per rank for a rank writing at
            least ``split_bytes``: each thread hashes its own file, so files hash in
            parallel. Smaller writes use one file: no empty or tiny extra shards.
        split_bytes: the size from which a rank's tensors are split over threads.
    """

    def __init__(self, path: str | os.PathLike[str], max_threads: int = 2, split_bytes: int = 16 << 20) -> None:
        super().__init__(path, thread_count=1)
        self.fs: HashingFileSystem = HashingFileSystem()
        self.max_threads = max_threads
        self.split_bytes = split_bytes
        self.staged = False  # set when the caller staged the tensors itself (StagingBuffers)

    def stage(self, state_dict: StateDict) -> StateDict:
        """DCP's async staging (a copy to CPU), skipped for tensors the caller staged already."""
        if self.staged:
            self.per_thread_copy_ahead = 0  # what FileSystemWriter.stage sets: the copies are on the CPU
            return state_dict
        return super().stage(state_dict)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        tensors = [item.tensor_data for item in plan.items if item.tensor_data is not None]
        # The bytes this rank writes: its chunk of each tensor, not the global size.
        nbytes = sum(t.chunk.sizes.numel() * t.properties.dtype.itemsize for t in tensors)
        # DCP fills one file per thread; with fewer items than threads one would stay empty.
        self.thread_count = min(self.max_threads, len(tensors)) if nbytes >= self.split_bytes else 1
        return super().write_data(plan, planner)

    def digests(self, step_dir: Path) -> dict[str, Digest]:
        """``{path relative to step_dir: digest}`` of the files written (and still there)."""
        with self.fs._lock:
            items = list(self.fs.digests.items())
        return {p.relative_to(step_dir).as_posix(): d for p, d in items if p.is_relative_to(step_dir)}


def write_file_hashed(path: Path, data: bytes | str) -> Digest:
    """Write ``data`` to ``path``, fsync it once, and return its digest."""
    raw = data.encode() if isinstance(data, str) else data
    with open(path, "wb") as f:
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())
    return {"size": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
