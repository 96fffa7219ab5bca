"""load_checkpoint: verify the commit marker, then load into any layout through DCP."""

from __future__ import annotations

import inspect
import json
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist
from safetensors.torch import load_file

# The defining submodules: mypy sees the package __init__'s names as not re-exported.
from torch.distributed.checkpoint import state_dict_loader as dcp_loader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from scaling.trainer.checkpoint import _marker as mk
from scaling.trainer.checkpoint._errors import CheckpointError
from scaling.trainer.checkpoint._safe_io import SafeFileSystemReader, SafeLoadPlanner, safe_load_metadata
from scaling.trainer.checkpoint._save import (
    EXTRA_FILE,
    SCALARS_FILE,
    _all_gather,
    _world,
    rank_file,
    without_single_process_warning,
)
from scaling.trainer.checkpoint._tree import decode_pytree, fill_state, flatten_state

_LOAD_TAKES_NO_DIST = "no_dist" in inspect.signature(dcp_loader.load).parameters

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from scaling.config import JsonDict, StateDict
    from scaling.topology import Topology

logger = logging.getLogger(__name__)


@dataclass
class LoadedCheckpoint:
    """What :func:`load_checkpoint` found and loaded.

    Attributes:
        step: the step loaded. path: its folder.
        state: the template with every loaded leaf filled in (tensors in place).
        extra: the JSON metadata saved with it.
        rank_state: this rank's ``rank_state`` when the world size is unchanged, else None.
        missing_keys / unexpected_keys: allowed keys absent from the checkpoint / the model.
        skipped: ``(step or path, reason)`` of newer checkpoints passed over by fallback.
    """

    step: int
    path: Path
    state: StateDict
    extra: StateDict
    rank_state: StateDict | None
    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)


def _verify(step_dir: Path, pg: ProcessGroup | None) -> JsonDict:
    rank, world = _world(pg)
    try:
        marker = mk.read_marker(step_dir)
        names = sorted(marker["files"])
        problems = mk.verify_files(step_dir, marker, names[rank::world])
        if rank == 0:
            problems += mk.unlisted_files(step_dir, marker)
    except CheckpointError as e:
        marker, problems = {}, [str(e)]
    problems = [p for part in _all_gather(problems, pg, world) for p in part]
    if problems:
        raise CheckpointError(f"checkpoint {step_dir} failed verification:\n  " + "\n  ".join(sorted(set(problems))))
    return marker


def _candidates(load_dir: Path, step: int | None, fallback: bool) -> tuple[list[int], list[tuple[str, str]]]:
    skipped: list[tuple[str, str]] = []
    if step is None:
        try:
            step = mk.read_latest(load_dir)
        except CheckpointError as e:
            if not fallback:
                raise
            skipped.append((str(load_dir / mk.LATEST), str(e)))
    committed = mk.committed_steps(load_dir)
    if step is None:
        if not committed:
            raise CheckpointError(f"no committed checkpoint (step_*/{mk.MARKER}) in {load_dir}")
        return sorted(committed, reverse=True), skipped
    first = [step]
    return first + (sorted((s for s in committed if s < step), reverse=True) if fallback else []), skipped


def _matches(key: str, patterns: Sequence[str]) -> bool:
    return any(re.fullmatch(p, key) for p in patterns)


def _copies(key: str, aliases: Mapping[str, Sequence[str]]) -> list[str]:
    """``key`` with the parameter key it names (a whole dot-separated run) replaced by each copy's key."""
    padded = f".{key}."
    for name, others in aliases.items():
        if f".{name}." in padded:
            return [padded.replace(f".{name}.", f".{other}.", 1)[1:-1] for other in others]
    return []


def load_checkpoint(
    load_dir: str | Path,
    state_template: StateDict,
    topology: Topology | None,
    *,
    step: int | None = None,
    fallback_to_previous: bool = False,
    allowed_missing: Sequence[str] = (),
    allowed_unexpected: Sequence[str] = (),
    ignored: Sequence[str] = (),
    aliases: Mapping[str, Sequence[str]] | None = None,
    process_group: ProcessGroup | None = None,
) -> LoadedCheckpoint:
    """Verify and load a checkpoint into this rank's ``state_template`` (any layout).

    Collective. Every file listed in ``commit.json`` is checked (size, sha256; spread over
    the ranks) before anything is read; no file is ever unpickled with arbitrary classes.

    Args:
        load_dir: the checkpoint root (holding ``latest`` and ``step_*`` folders).
        state_template: the state at the new layout, e.g. ``{"model":
            model_state_dict(...), "optimizer": optimizer.state_dict()}``; tensors are
            filled in place, scalar leaves replaced in the returned ``state``.
        topology: the topology, or ``None`` in one process without a process group.
        step: load this step instead of ``latest``.
        fallback_to_previous: on a corrupt checkpoint (or garbled ``latest``) load the
            newest older committed one and log a warning instead of raising.
        allowed_missing: regexes (full match) of template keys that may be absent.
        allowed_unexpected: regexes of checkpoint keys no rank's template holds.
        ignored: regexes of keys never loaded (the template keeps its values).
        aliases: parameter key -> the keys of copies of the same tensor (pipeline-tied
            weights, ``ParallelModule.tied_copies()``): a template key naming a parameter the
            checkpoint lacks is read from a copy it holds, and a copy no template names is
            not unexpected.
        process_group: the group to run on (default: the world).

    Raises:
        CheckpointError: no checkpoint, a garbled ``latest``, a file failing verification
            (named), a disallowed missing/unexpected key, or a shape mismatch.
    """
    load_dir = Path(load_dir)
    candidates, skipped = _candidates(load_dir, step, fallback_to_previous)
    for i, cand in enumerate(candidates):
        step_dir = load_dir / mk.step_dir_name(cand)
        try:
            marker = _verify(step_dir, process_group)
        except CheckpointError as e:
            if not fallback_to_previous or i == len(candidates) - 1:
                raise
            logger.warning("checkpoint step %d is unusable, falling back to an older one: %s", cand, e)
            skipped.append((str(cand), str(e)))
            continue
        loaded = _load_verified(
            step_dir,
            cand,
            marker,
            state_template,
            process_group,
            allowed_missing,
            allowed_unexpected,
            ignored,
            aliases or {},
        )
        loaded.skipped = skipped
        return loaded
    raise CheckpointError(f"no loadable checkpoint in {load_dir}")


def _read_json(path: Path) -> JsonDict:
    """Parse one of our JSON side files (each an object); anything else is a CheckpointError naming the file."""
    try:
        value = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not a valid checkpoint JSON file ({type(e).__name__}: {e})") from e
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: not a valid checkpoint JSON file (a {type(value).__name__}, not an object)")
    return value


def _load_verified(
    step_dir: Path,
    step: int,
    marker: JsonDict,
    template: StateDict,
    pg: ProcessGroup | None,
    allowed_missing: Sequence[str],
    allowed_unexpected: Sequence[str],
    ignored: Sequence[str],
    aliases: Mapping[str, Sequence[str]],
) -> LoadedCheckpoint:
    rank, world = _world(pg)
    metadata = safe_load_metadata(step_dir / ".metadata")
    ckpt_tensors = {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    saved_scalars = _read_json(step_dir / SCALARS_FILE)
    same_world = marker.get("world_size") == world
    own = _read_json(step_dir / rank_file(rank, "json")) if same_world else None
    scalar_values = dict(saved_scalars["values"])
    if own is not None:
        scalar_values.update({k: own["scalars"][k] for k in saved_scalars["per_rank_only"] if k in own["scalars"]})

    t_tensors, t_scalars = flatten_state(template)
    wanted = [k for k in [*t_tensors, *t_scalars] if not _matches(k, ignored)]
    present = set(ckpt_tensors) | set(scalar_values)
    # A template tensor the checkpoint holds under a copy's key only is read from that copy.
    read_from = {k: next((c for c in _copies(k, aliases) if c in ckpt_tensors), k) for k in t_tensors}
    missing = sorted(k for k in wanted if k not in present and read_from.get(k, k) not in ckpt_tensors)
    bad_missing = [k for k in missing if not _matches(k, allowed_missing)]
    all_template_keys = {k for part in _all_gather(sorted(set(t_tensors) | set(t_scalars)), pg, world) for k in part}
    candidates = set(ckpt_tensors) | set(saved_scalars["values"]) | set(saved_scalars["per_rank_only"])
    unexpected = sorted(
        k
        for k in candidates
        if k not in all_template_keys
        and not _matches(k, ignored)
        and not any(c in all_template_keys for c in _copies(k, aliases))
    )
    bad_unexpected = [k for k in unexpected if not _matches(k, allowed_unexpected)]
    errors = []
    if bad_missing:
        errors.append(
            f"keys missing from checkpoint {step_dir}: {bad_missing}; allow them with allowed_missing=[regex]"
        )
    if bad_unexpected:
        errors.append(
            f"checkpoint {step_dir} has keys no rank expects: {bad_unexpected}; "
            "allow them with allowed_unexpected=[regex] or skip them with ignored=[regex]"
        )
    # Keyed by the checkpoint's key: DCP reads that entry into the template's tensor.
    to_load = {read_from[k]: t for k, t in t_tensors.items() if k in wanted and read_from[k] in ckpt_tensors}
    for k, t in to_load.items():
        if tuple(t.shape) != tuple(ckpt_tensors[k].size):
            errors.append(f"{k}: checkpoint shape {list(ckpt_tensors[k].size)} != model shape {list(t.shape)}")
    if errors:
        raise CheckpointError("\n".join(errors))

    # torch 2.6's DCP load has no ``no_dist`` (without a process group it loads in one
    # process by itself); later versions take it.
    single = {"no_dist": not (dist.is_available() and dist.is_initialized())} if _LOAD_TAKES_NO_DIST else {}
    try:
        with without_single_process_warning():
            dcp_loader.load(
                to_load,
                storage_reader=SafeFileSystemReader(step_dir),
                planner=SafeLoadPlanner(allow_partial_load=True),
                process_group=pg,
                **single,
            )
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP wraps rank failures in a BaseException
        raise CheckpointError(f"{step_dir}: reading the DCP shards failed (refused or corrupt): {e}") from e
    filled = {k: scalar_values[k] for k in t_scalars if k in wanted and k in scalar_values}
    state = fill_state(template, filled)
    rank_state = None
    if own is not None:
        st = step_dir / rank_file(rank, "safetensors")
        try:
            tensors = load_file(str(st)) if st.is_file() else {}
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error type
            raise CheckpointError(f"{st}: not a valid safetensors file ({e})") from e
        decoded = decode_pytree(own["rank_state"], tensors)
        if decoded is not None and not isinstance(decoded, dict):
            raise CheckpointError(f"{step_dir / rank_file(rank, 'json')}: rank_state is a {type(decoded).__name__}")
        rank_state = decoded
    extra = _read_json(step_dir / EXTRA_FILE)
    return LoadedCheckpoint(step, step_dir, state, extra, rank_state, missing, unexpected)
