"""The commit marker, the ``latest`` pointer and the step folders on disk.

A step folder ``step_{N:08d}`` counts only once ``commit.json`` exists in it; the marker
lists every file of the checkpoint with its size and sha256, so loading can tell a
deleted, truncated, flipped or foreign file from a good one and name it. ``latest`` is a
one-line text file replaced atomically (temp file + ``os.replace``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from scaling.trainer.checkpoint._errors import CheckpointError

if TYPE_CHECKING:
    from scaling.config import JsonDict

MARKER = "commit.json"
LATEST = "latest"
FORMAT = "scaling-checkpoint/1"
_STEP_RE = re.compile(r"^step_(\d+)$")
_CHUNK = 8 << 20
# Threads hashing files at once: hashlib and file reads release the GIL, so files hash in
# parallel; capped because several ranks usually share one host's cores.
_HASH_THREADS = 4


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def hash_file(path: Path) -> JsonDict:
    """``{"size": bytes, "sha256": hex}`` of one file."""
    digest = hashlib.sha256()
    size = 0
    # One reused buffer: no allocation per chunk, and hashlib reads the memoryview in place.
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            digest.update(view[:n])
            size += n
    return {"size": size, "sha256": digest.hexdigest()}


def hash_files(paths: Sequence[Path]) -> list[JsonDict]:
    """:func:`hash_file` of each path, several files at once in threads."""
    if len(paths) <= 1:
        return [hash_file(p) for p in paths]
    with ThreadPoolExecutor(max_workers=min(_HASH_THREADS, len(paths))) as pool:
        return list(pool.map(hash_file, paths))


def list_files(step_dir: Path) -> list[str]:
    """Every regular file under ``step_dir`` (relative POSIX paths) except the marker."""
    out = []
    for root, _, names in os.walk(step_dir):
        for name in names:
            rel = (Path(root) / name).relative_to(step_dir).as_posix()
            if rel != MARKER:
                out.append(rel)
    return sorted(out)


def write_json_atomic(path: Path, obj: object) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_marker(step_dir: Path, step: int, files: dict[str, JsonDict], info: JsonDict) -> None:
    """Write ``commit.json`` last: from here on the step folder counts."""
    write_json_atomic(step_dir / MARKER, {"format": FORMAT, "step": step, "files": files, **info})


def write_latest(save_dir: Path, step: int) -> None:
    tmp = save_dir / f".{LATEST}.tmp{os.getpid()}"
    # No fsync: it would widen the window between the marker and ``latest`` in which a killed
    # rank 0 leaves ``latest`` one committed step behind (still a good one).
    tmp.write_text(step_dir_name(step) + "\n")
    os.replace(tmp, save_dir / LATEST)


def read_marker(step_dir: Path) -> JsonDict:
    path = step_dir / MARKER
    try:
        marker = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist: {step_dir} is not a committed checkpoint") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: commit marker is not valid JSON ({e}); the checkpoint is corrupt") from e
    if not isinstance(marker, dict) or marker.get("format") != FORMAT or not isinstance(marker.get("files"), dict):
        raise CheckpointError(f"{path}: not a {FORMAT} commit marker; the checkpoint is corrupt")
    return marker


def verify_files(step_dir: Path, marker: JsonDict, names: list[str]) -> list[str]:
    """Problems (each naming the file) among ``names`` of the marker's files."""
    problems = []
    to_hash = []
    for name in names:
        path = step_dir / name
        want = marker["files"][name]
        if not path.is_file():
            problems.append(f"{path}: listed in {MARKER} but missing (deleted?)")
            continue
        size = path.stat().st_size
        if size != want["size"]:
            problems.append(f"{path}: size {size} bytes != {want['size']} recorded in {MARKER} (truncated?)")
        else:
            to_hash.append(name)
    for name, got in zip(to_hash, hash_files([step_dir / n for n in to_hash])):
        if got["sha256"] != marker["files"][name]["sha256"]:
            problems.append(f"{step_dir / name}: sha256 differs from {MARKER} (corrupted or modified)")
    return problems


def unlisted_files(step_dir: Path, marker: JsonDict) -> list[str]:
    """Problems for files in the folder that the marker does not list (never loaded)."""
    return [
        f"{step_dir / name}: not listed in {MARKER}; a file was added after the commit, refusing to load"
        for name in list_files(step_dir)
        if name not in marker["files"]
    ]


def step_folders(save_dir: Path) -> dict[int, Path]:
    """``{step: folder}`` of every ``step_*`` folder, committed or not.

    A ``step_*`` entry that is a symbolic link is no checkpoint folder: it is never listed, so
    pruning, clean-up and loading never follow it out of ``save_dir`` (saving to its step is
    refused: :func:`check_step_dir`).
    """
    if not save_dir.is_dir():
        return {}
    out = {}
    for p in save_dir.iterdir():
        m = _STEP_RE.match(p.name)
        if m and p.is_dir() and not p.is_symlink():
            out[int(m.group(1))] = p
    return out


def check_step_dir(step_dir: Path) -> None:
    """Refuse a step folder that is a symbolic link (or any other non-folder entry).

    Raises:
        CheckpointError: naming the path and the fix.
    """
    if step_dir.is_symlink():
        raise CheckpointError(
            f"{step_dir} is a symbolic link (to {os.readlink(step_dir)}): checkpoints are never written, "
            "loaded or deleted through links inside save_dir; remove the link or save elsewhere"
        )
    if step_dir.exists() and not step_dir.is_dir():
        raise CheckpointError(f"{step_dir} exists and is not a folder; remove it or save elsewhere")


def delete_checkpoints(save_dir: Path) -> list[int]:
    """Delete every step folder (committed or not) and ``latest`` in ``save_dir``; returns the steps.

    Markers go first, then ``latest``, so an interrupted deletion leaves nothing loadable half
    deleted. Links are left alone (:func:`step_folders`).
    """
    folders = step_folders(save_dir)
    for path in folders.values():
        (path / MARKER).unlink(missing_ok=True)
    latest = save_dir / LATEST
    if latest.is_file() and not latest.is_symlink():
        latest.unlink()
    for path in folders.values():
        shutil.rmtree(path, ignore_errors=True)
    return sorted(folders)


def committed_steps(save_dir: str | Path) -> list[int]:
    """Steps whose folder has a commit marker, ascending."""
    return sorted(s for s, p in step_folders(Path(save_dir)).items() if (p / MARKER).is_file())


def read_latest(save_dir: Path) -> int:
    """The step ``latest`` points to.

    Raises:
        CheckpointError: ``latest`` is missing, garbled or points to an uncommitted folder.
    """
    path = save_dir / LATEST
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist: no committed checkpoint in {save_dir}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable ({e}); pass step=... to load_checkpoint") from e
    m = _STEP_RE.match(text)
    if not m:
        raise CheckpointError(f"{path}: garbled content {text[:60]!r}, expected 'step_<N>'; pass step=... explicitly")
    step = int(m.group(1))
    check_step_dir(save_dir / step_dir_name(step))
    if not (save_dir / step_dir_name(step) / MARKER).is_file():
        raise CheckpointError(f"{path}: points to {text!r}, which is not a committed checkpoint")
    return step


def remove_uncommitted(save_dir: Path, keep: int | None = None) -> list[int]:
    """Delete step folders without a marker (except step ``keep``); returns their steps."""
    removed = []
    for step, path in step_folders(save_dir).items():
        if step != keep and not (path / MARKER).is_file():
            shutil.rmtree(path, ignore_errors=True)
            removed.append(step)
    return sorted(removed)


def prune(save_dir: Path, keep_last: int, current: int) -> list[int]:
    """Delete all but the newest ``keep_last`` committed checkpoints; returns removed steps.

    ``current``, the step just committed (the one ``latest`` names), is never deleted, even
    where the folder holds higher steps of an earlier run.
    """
    steps = committed_steps(save_dir)
    doomed = [s for s in (steps[:-keep_last] if keep_last > 0 else []) if s != current]
    for step in doomed:
        path = save_dir / step_dir_name(step)
        # The marker goes first, so a half-deleted folder is never taken for a good one.
        (path / MARKER).unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)
    return doomed
