"""In-memory checkpoints: each rank's own state in host memory that outlives its process.

A copy is this rank's local state exactly as it holds it (its pieces of the parameters and
of the optimizer state, its scalars, the loader position and counters, its RNG streams),
written by a background thread to ``<folder>/step_<N>/rank_<R>.safetensors`` with the
rest in ``rank_<R>.json``, which is renamed into place last: the rank's commit. The folder is
meant to be on a memory filesystem (``/dev/shm``), so the copy survives the death of the
training processes on the node (not of the node). Restoring reads this rank's own files
back into the same state objects at the same layout: a restart by the launcher keeps the
world. Nothing is pickled; each rank keeps its two newest steps.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor

from scaling.config import StateDict
from scaling.trainer.checkpoint._tree import decode_pytree, encode_pytree, fill_state, flatten_state

_STEP = re.compile(r"step_(\d{8})$")
KEEP = 2


class MemoryCheckpoints:
    """This rank's in-memory copies under ``folder`` (see the module docstring).

    Args:
        folder: shared by the ranks of a node (each writes only its own files).
        rank: this process's global rank (names its files).
    """

    def __init__(self, folder: Path, rank: int) -> None:
        self.folder, self.rank = folder, rank
        self._buffers: dict[str, torch.Tensor] = {}
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def _files(self, step: int) -> tuple[Path, Path]:
        step_dir = self.folder / f"step_{step:08d}"
        return step_dir / f"rank_{self.rank}.safetensors", step_dir / f"rank_{self.rank}.json"

    def held_steps(self) -> list[int]:
        """The steps whose copy this rank finished writing, oldest first."""
        if not self.folder.is_dir():
            return []
        steps = []
        for entry in self.folder.iterdir():
            match = _STEP.match(entry.name)
            if match and self._files(int(match.group(1)))[1].is_file():
                steps.append(int(match.group(1)))
        return sorted(steps)

    def save(self, step: int, sharded: StateDict, others: Mapping[str, object]) -> None:
        """Copy ``sharded`` (tensors and DTensors: their local pieces; scalars) and ``others``
        (JSON-able state, RNG states) now, and write them in the background.

        The tensors are copied into kept host buffers before this returns (CUDA ones by
        non-blocking copies, waited for by the writer), so training may change them at once.
        The previous copy is finished first.
        """
        self.wait()
        tensors, scalars = flatten_state(sharded)
        staged: dict[str, torch.Tensor] = {}
        on_cuda = False
        for key, value in tensors.items():
            local = (value.to_local() if isinstance(value, DTensor) else value).detach()
            cuda = local.device.type == "cuda"
            buffer = self._buffers.get(key)
            if buffer is None or buffer.shape != local.shape or buffer.dtype != local.dtype:
                buffer = self._buffers[key] = torch.empty(local.shape, dtype=local.dtype, pin_memory=cuda)
            buffer.copy_(local, non_blocking=cuda)
            on_cuda |= cuda
            staged[f"sharded/{key}"] = buffer
        done = torch.cuda.Event() if on_cuda else None  # after the copies on the current stream
        if done is not None:
            done.record()
        others_tensors: dict[str, torch.Tensor] = {}
        encoded = encode_pytree(dict(others), others_tensors)
        staged.update({f"others/{k}": v for k, v in others_tensors.items()})
        record = {"step": step, "scalars": scalars, "others": encoded}
        self._thread = threading.Thread(
            target=self._write, args=(step, staged, record, done), name="scaling-memory-checkpoint", daemon=True
        )
        self._thread.start()

    def _write(self, step: int, tensors: dict[str, torch.Tensor], record: object, done: object) -> None:
        try:
            if done is not None:
                done.synchronize()  # type: ignore[attr-defined]
            data, marker = self._files(step)
            data.parent.mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(data) + ".tmp")
            os.replace(str(data) + ".tmp", data)
            Path(str(marker) + ".tmp").write_text(json.dumps(record))
            os.replace(str(marker) + ".tmp", marker)  # this rank's copy of the step is complete
            for old in self.held_steps()[:-KEEP]:
                self._remove(old)
        except Exception as exc:  # noqa: BLE001 (re-raised by wait(), on the trainer's thread)
            self._error = exc

    def wait(self) -> None:
        """Finish the copy being written; raise what writing it raised."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(f"writing this rank's in-memory checkpoint to {self.folder} failed: {error}") from error

    def load(self, step: int, sharded: StateDict) -> tuple[StateDict, dict[str, object]]:
        """This rank's copy of ``step``: its tensors copied into ``sharded``'s own (the state
        objects' current state, at the layout the copy was taken), its scalars put in place;
        and the other state as saved.

        Raises:
            ValueError: a tensor of the copy does not fit (another layout or model).
        """
        data, marker = self._files(step)
        record = json.loads(marker.read_text())
        saved = load_file(str(data))
        tensors, _ = flatten_state(sharded)
        with torch.no_grad():
            for key, value in tensors.items():
                local = value.to_local() if isinstance(value, DTensor) else value
                copy = saved.get(f"sharded/{key}")
                if copy is None or copy.shape != local.shape or copy.dtype != local.dtype:
                    found = "nothing" if copy is None else f"{list(copy.shape)} {copy.dtype}"
                    raise ValueError(
                        f"in-memory checkpoint {data}: {key!r} holds {found}, this rank has {list(local.shape)} "
                        f"{local.dtype}; a copy restores the same model at the same layout only"
                    )
                local.copy_(copy)
        filled = fill_state(sharded, record["scalars"])
        others = {k[len("others/") :]: v for k, v in saved.items() if k.startswith("others/")}
        decoded = decode_pytree(record["others"], others)
        assert isinstance(decoded, dict)
        return filled, decoded

    def _remove(self, step: int) -> None:
        """This rank's files of ``step``, finished or not; the last rank to leave removes the folder."""
        for path in self._files(step):
            path.unlink(missing_ok=True)
            Path(str(path) + ".tmp").unlink(missing_ok=True)
        try:
            path.parent.rmdir()
        except OSError:
            pass

    def clear(self, keep: int | None = None) -> None:
        """Remove this rank's files of every step but ``keep`` (all of them: the run is over,
        and the folder goes with the last rank's)."""
        self.wait()
        if not self.folder.is_dir():
            return
        for entry in self.folder.iterdir():
            match = _STEP.match(entry.name)
            if match and int(match.group(1)) != keep:
                self._remove(int(match.group(1)))
        try:
            self.folder.rmdir()
        except OSError:
            pass
