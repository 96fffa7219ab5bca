"""In-memory checkpoints: each rank's own state in host memory that outlives its process.

A copy is this rank's local state exactly as it holds it (its pieces of the parameters and
of the optimizer state, its scalars, the loader position and counters, its RNG streams). Each
rank keeps two slots, ``<folder>/rank_<R>/slot_{0,1}.bin``: files on a memory filesystem
(``/dev/shm``) mapped into the process, so a copy is one ``copy_`` of each tensor into the
mapping and nothing else (no serialisation, no second copy, no writer thread) and survives
the death of the process (not of the node). ``slot_<s>.json`` (the step, where each tensor
lies, the scalars and the rest) is renamed into place after the copy: the slot's commit. A
save overwrites the slot that does not hold the newest step, removing its commit first, so a
rank killed mid-copy still holds the step before. Restoring copies the rank's own slot back
into the state objects at the same layout: a restart by the launcher keeps the world, and no
rank reads another's files. Nothing is pickled.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from scaling.config import StateDict
from scaling.trainer.checkpoint._tree import decode_pytree, encode_pytree, fill_state, flatten_state

_ALIGN = 64
SLOTS = (0, 1)


def _layout(tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, list[object]], int]:
    """Each tensor's ``[byte offset, shape, dtype name]`` in one flat buffer, and the buffer's size."""
    layout: dict[str, list[object]] = {}
    offset = 0
    for key, t in tensors.items():
        layout[key] = [offset, list(t.shape), str(t.dtype).removeprefix("torch.")]
        offset += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    return layout, max(offset, _ALIGN)


def _view(buffer: torch.Tensor, place: list[object]) -> torch.Tensor:
    offset, shape, dtype_name = place
    dtype = getattr(torch, str(dtype_name))
    assert isinstance(offset, int) and isinstance(shape, list)
    return buffer[offset : offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)


class MemoryCheckpoints:
    """This rank's two in-memory copies under ``folder`` (see the module docstring).

    Args:
        folder: shared by the ranks of a node (each writes only ``rank_<R>/``).
        rank: this process's global rank.
    """

    def __init__(self, folder: Path, rank: int) -> None:
        self.folder, self.rank = folder, rank
        self._dir = folder / f"rank_{rank}"
        self._maps: dict[int, torch.Tensor] = {}  # slot -> its file, mapped (uint8)

    def _marker(self, slot: int) -> Path:
        return self._dir / f"slot_{slot}.json"

    def _data(self, slot: int) -> Path:
        return self._dir / f"slot_{slot}.bin"

    def _committed(self) -> dict[int, dict[str, object]]:
        records = {}
        for slot in SLOTS:
            try:
                records[slot] = json.loads(self._marker(slot).read_text())
            except FileNotFoundError:
                continue
        return records

    def held_steps(self) -> list[int]:
        """The steps this rank holds a whole copy of, oldest first."""
        return sorted(int(r["step"]) for r in self._committed().values())  # type: ignore[call-overload]

    def _map(self, slot: int, size: int | None = None) -> torch.Tensor:
        """Slot ``slot``'s file mapped into this process, first made ``size`` bytes long (default:
        as it is; its contents stay)."""
        mapped = self._maps.get(slot)
        if mapped is None or (size is not None and mapped.numel() != size):
            path = self._data(slot)
            if size is not None:
                self._dir.mkdir(parents=True, exist_ok=True)
                path.touch()
                os.truncate(path, size)
            size = path.stat().st_size
            mapped = self._maps[slot] = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
        return mapped

    def save(self, step: int, sharded: StateDict, others: Mapping[str, object]) -> None:
        """Copy ``sharded`` (tensors and DTensors: their local pieces; scalars) and ``others``
        (JSON-able state, RNG states) of ``step`` into the slot not holding the newest step."""
        tensors, scalars = flatten_state(sharded)
        local = {f"sharded/{k}": v.to_local() if isinstance(v, DTensor) else v for k, v in tensors.items()}
        others_tensors: dict[str, torch.Tensor] = {}
        encoded = encode_pytree(dict(others), others_tensors)
        local.update({f"others/{k}": v for k, v in others_tensors.items()})
        committed = self._committed()
        slot = min(SLOTS, key=lambda s: int(committed[s]["step"]) if s in committed else -1)  # type: ignore[call-overload]
        layout, size = _layout(local)
        self._marker(slot).unlink(missing_ok=True)  # uncommitted while it is overwritten
        buffer = self._map(slot, size)
        with torch.no_grad():
            for key, value in local.items():
                _view(buffer, layout[key]).copy_(value.detach())
        record = {"step": step, "layout": layout, "scalars": scalars, "others": encoded}
        # Compact and not fsynced, unlike the disk markers' write_json_atomic: memory has no disk to
        # reach, and the indented RNG state alone cost 2 ms a copy.
        tmp = self._marker(slot).with_suffix(".json.tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, self._marker(slot))  # this rank's copy of the step is whole

    def load(self, step: int, sharded: StateDict) -> tuple[StateDict, dict[str, object]]:
        """This rank's copy of ``step`` in the shape of ``sharded`` (the state as this rank holds it
        now, taken at the same layout): its tensors copied out of the slot, its scalars; and the
        other state as saved.

        Raises:
            ValueError: a tensor of the copy does not fit (another layout or model).
        """
        slot, record = next((s, r) for s, r in self._committed().items() if r["step"] == step)
        layout = record["layout"]
        assert isinstance(layout, dict)
        buffer = self._map(slot)
        template, _ = flatten_state(sharded)
        values: dict[str, object] = dict(record["scalars"])  # type: ignore[call-overload]
        for key, value in template.items():
            target = value.to_local() if isinstance(value, DTensor) else value
            place = layout.get(f"sharded/{key}")
            copy = None if place is None else _view(buffer, place)
            if copy is None or copy.shape != target.shape or copy.dtype != target.dtype:
                found = "nothing" if copy is None else f"{list(copy.shape)} {copy.dtype}"
                raise ValueError(
                    f"in-memory checkpoint {self._data(slot)}: {key!r} holds {found}, this rank has "
                    f"{list(target.shape)} {target.dtype}; a copy restores the same model at the same layout only"
                )
            values[key] = copy.clone()
        others = {
            k.removeprefix("others/"): _view(buffer, p).clone() for k, p in layout.items() if k.startswith("others/")
        }
        decoded = decode_pytree(record["others"], others)
        assert isinstance(decoded, dict)
        return fill_state(sharded, values), decoded

    def clear(self, keep: int | None = None) -> None:
        """Remove this rank's files but the copy of step ``keep`` (all of them: the run is over, and
        the folder goes with the last rank's)."""
        kept = {p for s, r in self._committed().items() if r["step"] == keep for p in (self._data(s), self._marker(s))}
        self._maps = {s: m for s, m in self._maps.items() if self._data(s) in kept}
        if self._dir.is_dir():
            for path in self._dir.iterdir():  # slots, markers and what a killed rank left half-written
                if path not in kept:
                    path.unlink(missing_ok=True)
        for folder in (self._dir, self.folder):
            try:
                folder.rmdir()
            except OSError:  # not empty (another rank's, or the copy kept), or gone
                break
