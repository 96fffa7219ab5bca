"""DCP reading without arbitrary unpickling.

``FileSystemReader.read_metadata`` calls ``pickle.load`` on ``.metadata`` and
``DefaultLoadPlanner.load_bytes`` calls ``torch.load(..., weights_only=False)`` (torch
2.13): both would run any ``__reduce__`` payload dropped into a checkpoint folder. Tensor
payloads themselves are read with ``weights_only=True`` by the reader. Here the metadata
goes through an allow-listed unpickler (only DCP's metadata dataclasses, ``torch.Size``,
dtypes, layouts and paths), and byte items (which our writer never produces: scalars are
JSON) are refused outright.
"""

from __future__ import annotations

import io
import pathlib
import pickle
from typing import IO

import torch

# The defining submodules: mypy sees the package __init__'s names as not re-exported.
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from scaling.trainer.checkpoint._errors import CheckpointError

_METADATA_CLASSES = {
    "Metadata",
    "MetadataIndex",
    "StorageMeta",
    "TensorProperties",
    "TensorStorageMetadata",
    "ChunkStorageMetadata",
    "BytesStorageMetadata",
    "_MEM_FORMAT_ENCODING",
}
_ALLOWED: dict[str, set[str]] = {
    "torch.distributed.checkpoint.metadata": _METADATA_CLASSES,
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    # Rebuilds a layout from its name (e.g. "torch.strided"); runs no user code.
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, file: IO[bytes], path: str) -> None:
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str) -> object:
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise CheckpointError(
            f"{self._path}: refusing to unpickle {module}.{name}; checkpoint metadata may only reference "
            "DCP metadata classes, torch.Size and dtypes. The file was tampered with or not written by "
            "scaling.trainer.checkpoint; do not load it"
        )


def safe_load_metadata(path: str | pathlib.Path) -> Metadata:
    """Read a DCP ``.metadata`` file through the allow-listed unpickler."""
    with open(path, "rb") as f:
        try:
            metadata = _RestrictedUnpickler(f, str(path)).load()
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - any decoding failure means a corrupt file
            raise CheckpointError(f"{path}: cannot decode DCP metadata ({type(e).__name__}: {e})") from e
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path}: expected DCP Metadata, found {type(metadata).__name__}")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """A ``FileSystemReader`` whose metadata is read without arbitrary unpickling."""

    def read_metadata(self, *args: object, **kwargs: object) -> Metadata:
        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        metadata = safe_load_metadata(pathlib.Path(self.path) / name)
        storage_meta = getattr(metadata, "storage_meta", None)
        if storage_meta is None:
            storage_meta = metadata.storage_meta = StorageMeta()
        storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """A ``DefaultLoadPlanner`` that refuses pickled (non-tensor) items."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise CheckpointError(
            f"checkpoint item {read_item.dest_index.fqn!r} is a pickled object; scaling.trainer.checkpoint "
            "stores only tensors in DCP shards (scalars go to JSON) and refuses to unpickle it"
        )
