"""A run's checkpoints: a mapping of ``Stateful`` objects, saved and restored through
scaling.trainer.checkpoint, knowing nothing of the trainer that owns them.

Sharded, layout-independent state (``"model"``: parameters as DTensors keyed by ``meta.key``;
``"optimizer"``: its state the same way) goes to DCP shards, so it reshards on load.
``"rng"`` is per rank and restored only when the world size is unchanged (another layout
has other streams). Every other entry (the trainer's counters and the data-loader
position) goes to ``extra.json``, with the world size and the run's config.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from scaling.topology import get_rng_state, set_rng_state
from scaling.trainer import checkpoint as ckpt
from scaling.trainer._config import TrainerConfig
from scaling.trainer.checkpoint._marker import step_dir_name

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.checkpoint.stateful import Stateful

    from scaling.config import StateDict
    from scaling.topology import RNGTracker, Topology
    from scaling.trainer.checkpoint import PendingSave, StagingBuffers
    from scaling.trainer.checkpoint._model_state import NamedParameters

#: The entries of a checkpoint's state that go to DCP shards; ``RANK_ENTRY`` is saved per rank.
SHARDED_ENTRIES = ("model", "optimizer")
RANK_ENTRY = "rng"


def restart_count() -> int:
    """How many times the launcher restarted this run's workers (torchrun's ``TORCHELASTIC_RESTART_COUNT``)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class ModelState:
    """The ``"model"`` entry: the parameters (with their metas) as layout-independent DTensors.

    Args:
        named_parameters: gives ``(name, parameter, meta)`` of this rank's parameters
            (``ParallelModule.named_parameters_with_meta``).
        topology: the run's topology.
        before_read: waits for parameter updates still in flight (default: nothing).
        after_load: tells whoever keeps a copy of the parameters that they were written
            (the optimizer's master weights and ZeRO-3 shards; default: nothing).
        tied_copies: parameter key -> the keys of its pipeline-tied copies
            (``ParallelModule.tied_copies``; default: none), read in its place when a
            checkpoint saved with fewer stages lacks it.
    """

    def __init__(
        self,
        named_parameters: Callable[[], NamedParameters],
        topology: Topology,
        before_read: Callable[[], None] = lambda: None,
        after_load: Callable[[], None] = lambda: None,
        tied_copies: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        self._named, self._topology = named_parameters, topology
        self._before_read, self._after_load = before_read, after_load
        self.tied_copies: Mapping[str, Sequence[str]] = tied_copies or {}

    def _parameters(self) -> NamedParameters:
        return list(self._named())

    def state_dict(self, owned: bool = False) -> StateDict:
        """DTensors of the logical shapes; ``owned``: this rank's parameters as it holds them (views)."""
        self._before_read()
        if owned:
            return {meta.key: param.detach() for _, param, meta in self._parameters()}
        return ckpt.model_state_dict(self._parameters(), self._topology)

    def load_state_dict(self, state: StateDict, owned: bool = False) -> None:
        if owned:
            with torch.no_grad():
                for _, param, meta in self._parameters():
                    param.copy_(state[meta.key])
        else:
            ckpt.load_model_state_dict(self._parameters(), state)
        self._after_load()


class RNGState:
    """The ``"rng"`` entry: this rank's random-number streams (``get_rng_state(tracker)``)."""

    def __init__(self, tracker: RNGTracker | None) -> None:
        self._tracker = tracker

    def state_dict(self) -> StateDict:
        return get_rng_state(self._tracker)

    def load_state_dict(self, state: StateDict) -> None:
        set_rng_state(state, self._tracker)


class TrainerCheckpointer:
    """Saves and restores a run's state, a mapping of ``Stateful`` objects.

    Args:
        config: the trainer section (folders, ``resume``, ``async_save``, what to load).
        topology: the run's topology.
        states: by name: ``"model"`` (a :class:`ModelState`) and ``"optimizer"`` go to DCP
            shards, ``"rng"`` (an :class:`RNGState`) is per rank, every other entry to
            ``extra.json``; all are loaded in the mapping's order, the extra ones and
            ``"rng"`` only with ``config.load_context``.
        step: the current optimizer step (names the folder).
        console: where the checkpointer says what it did.
        whole_parameters: a context in which every parameter is whole (ZeRO-3 gathers them),
            held while the model is read for a save and while it is loaded.
        metadata: saved beside the state for people and tools, never loaded (the config).
    """

    def __init__(
        self,
        config: TrainerConfig,
        topology: Topology,
        states: Mapping[str, Stateful],
        *,
        step: Callable[[], int],
        console: Callable[[str], None],
        whole_parameters: Callable[[], AbstractContextManager[None]] = nullcontext,
        metadata: Mapping[str, object] | None = None,
    ) -> None:
        self.config, self.topology, self.states = config, topology, dict(states)
        self._step, self._console, self._whole = step, console, whole_parameters
        self._metadata = dict(metadata or {})
        self._pending: PendingSave | None = None
        self._group: ProcessGroup | None = None
        self._staging: StagingBuffers | None = None  # made by the first asynchronous save, then reused
        self.last_loaded_step: int | None = None
        self.last_saved_step: int | None = None
        folder = config.resolved_memory_checkpoint_dir()
        self.memory = None if folder is None else ckpt.MemoryCheckpoints(folder, topology.global_rank)
        self._takes_owned = {
            name
            for name in SHARDED_ENTRIES
            if name in self.states and "owned" in inspect.signature(self.states[name].state_dict).parameters
        }
        self.last_memory_step: int | None = None

    def _sharded(self, names: tuple[str, ...] = SHARDED_ENTRIES) -> StateDict:
        return {name: self.states[name].state_dict() for name in names if name in self.states}

    def _owned(self) -> StateDict:
        """The sharded entries as this rank holds them (``state_dict(owned=True)`` where the state
        object takes it: no collective, no copy), for an in-memory copy."""
        return {
            name: state.state_dict(owned=True) if name in self._takes_owned else state.state_dict()  # type: ignore[call-arg]
            for name in SHARDED_ENTRIES
            if (state := self.states.get(name)) is not None
        }

    def _extra_names(self) -> list[str]:
        return [name for name in self.states if name not in SHARDED_ENTRIES and name != RANK_ENTRY]

    def save_to_memory(self) -> None:
        """Copy this rank's state of the current step to host memory (once; a no-op when there
        are no in-memory copies), read after a restart."""
        step = self._step()
        if self.memory is None or self.last_memory_step == step:
            return
        others: dict[str, object] = {"extra": {name: self.states[name].state_dict() for name in self._extra_names()}}
        if (rank := self.states.get(RANK_ENTRY)) is not None:
            others["rng"] = rank.state_dict()
        with self._whole():  # ZeRO-3: the parameters are read whole, as for a save
            self.memory.save(step, self._owned(), others)
        self.last_memory_step = step

    def after_step(self, step: int, save_dir: Path | None) -> None:
        """At the end of training step ``step``: save to ``save_dir`` when given (memory too), else
        copy to memory on ``memory_checkpoint_interval``."""
        interval = self.config.memory_checkpoint_interval
        if save_dir is not None:
            self.save(save_dir)
        elif interval is not None and step % interval == 0:
            self.save_to_memory()

    def drop_memory(self) -> None:
        """Remove this rank's in-memory copies: the run finished, no restart needs them."""
        if self.memory is not None:
            self.memory.clear()

    def save(self, save_dir: Path) -> None:
        """Save the current step (once), to memory too; the previous asynchronous save is finished first."""
        cfg, step = self.config, self._step()
        if self.last_saved_step == step:
            return
        self.save_to_memory()  # the newest copy in memory is never older than the newest on disk
        self.wait()
        if cfg.async_save:
            if self._group is None and dist.is_initialized():
                self._group = ckpt.new_checkpoint_group()
            if self._staging is None:
                self._staging = ckpt.StagingBuffers()
        extra: dict[str, object] = {name: self.states[name].state_dict() for name in self._extra_names()}
        extra.update(world_size=self.topology.world_size, **self._metadata)
        rank = self.states.get(RANK_ENTRY)
        # ZeRO-3 parameters are whole while the save reads them (an asynchronous save has
        # copied them into its staging buffers when save_checkpoint returns).
        with self._whole():
            self._pending = ckpt.save_checkpoint(
                save_dir,
                step,
                self._sharded(),
                self.topology,
                extra=extra,
                rank_state=None if rank is None else rank.state_dict(),
                keep_last=cfg.keep_last_n_checkpoints,
                async_save=cfg.async_save,
                process_group=self._group,
                staging=self._staging,
            )
        self.last_saved_step = step
        if not cfg.async_save:
            self.wait()

    def last_saved_path(self) -> Path | None:
        """The folder of the checkpoint this run saved last, or None."""
        save_dir, step = self.config.save_dir, self.last_saved_step
        return None if save_dir is None or step is None else save_dir / step_dir_name(step)

    def wait(self) -> None:
        if self._pending is not None:
            self._pending.wait()
            self._pending = None

    def start(self) -> None:
        """Load what the run starts from, by ``trainer.load_dir`` and ``trainer.resume``.

        With ``resume="auto"`` and no ``load_dir``, committed checkpoints in ``save_dir`` are
        resumed from (a second run of the same command continues the first). ``load_dir``
        elsewhere while ``save_dir`` already holds committed checkpoints is refused before
        training: the new run's saves would collide with them or be pruned in their favour.
        ``resume="fresh"`` deletes them (rank 0, then a barrier) and says what it deleted.

        Raises:
            CheckpointError: ``save_dir`` holds another run's checkpoints and ``load_dir``
                names another folder (``resume="auto"``).
        """
        if self._resume_from_memory():
            return
        cfg = self.config
        save_dir, load_dir = cfg.save_dir, cfg.load_dir
        steps = self._committed_steps_seen_by_rank_0(save_dir)
        if steps:
            assert save_dir is not None
            if cfg.resume == "fresh" and restart_count() == 0:  # a restarted worker resumes its own run
                self._console(
                    f"trainer.resume=fresh: deleting the {len(steps)} committed checkpoint(s) in {save_dir} "
                    f"(steps {steps[0]}..{steps[-1]}) before training"
                )
                if self.topology.global_rank == 0:
                    ckpt.delete_checkpoints(save_dir)
                if dist.is_initialized():
                    dist.barrier()
            elif load_dir is None:
                load_dir = save_dir
            elif load_dir.resolve() != save_dir.resolve():
                raise ckpt.CheckpointError(
                    f"trainer.save_dir={save_dir} already holds committed checkpoints (steps {steps[0]}..{steps[-1]}) "
                    f"while trainer.load_dir={load_dir} is another folder: this run's saves would collide with them. "
                    "Save into a new folder, resume from it (trainer.load_dir=null), or delete them first with "
                    "trainer.resume=fresh"
                )
        if load_dir is not None:
            self.load(load_dir)

    def _resume_from_memory(self) -> bool:
        """After a restart by the launcher: load the newest step every rank holds in memory, and say so.

        On a first start, copies left under the same folder by an earlier job are removed.
        """
        memory = self.memory
        if memory is None:
            return False
        if restart_count() == 0:
            memory.clear()
            return False
        held = memory.held_steps()
        every = set(held)
        if dist.is_initialized() and dist.get_world_size() > 1:
            views: list[list[int]] = [[] for _ in range(dist.get_world_size())]
            dist.all_gather_object(views, held)
            every = set.intersection(*(set(v) for v in views))
        if not every:
            self._console(
                f"restart {restart_count()}: no step is held in memory by every rank ({memory.folder}); "
                "resuming as at a first start"
            )
            return False
        step = max(every)
        with self._whole():  # ZeRO-3: loaded into the gathered parameters, as from disk
            state, others = memory.load(step, self._owned())
            self._load_entry("model", state["model"])
        if "optimizer" in state:  # after the model: its own state overrides the masters taken from it
            self._load_entry("optimizer", state["optimizer"])
        extra = others["extra"]
        assert isinstance(extra, dict)
        for name in self._extra_names():
            self.states[name].load_state_dict(extra[name])
        if (rank := self.states.get(RANK_ENTRY)) is not None:
            rank.load_state_dict(others["rng"])  # type: ignore[arg-type]
        memory.clear(keep=step)  # the later, partial copies of the attempt that failed go
        self.last_loaded_step = self.last_memory_step = step
        self._console(
            f"restart {restart_count()}: resumed from the in-memory checkpoint of step {step} in {memory.folder} "
            "(nothing read from save_dir)"
        )
        return True

    def _load_entry(self, name: str, entry: StateDict) -> None:
        if name in self._takes_owned:
            self.states[name].load_state_dict(entry, owned=True)  # type: ignore[call-arg]
        else:
            self.states[name].load_state_dict(entry)

    def _committed_steps_seen_by_rank_0(self, save_dir: Path | None) -> list[int]:
        """The committed steps of ``save_dir``, read once by global rank 0 and sent to every rank: each
        rank acts on one view (a slower rank reading for itself could find rank 0's resume=fresh
        deletion done, skip the barrier after it and leave rank 0 waiting there)."""
        if save_dir is None:
            return []
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return ckpt.committed_steps(save_dir)
        box: list[list[int] | None] = [ckpt.committed_steps(save_dir) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        assert box[0] is not None
        return box[0]

    def load(self, load_dir: Path) -> None:
        """Restore the latest committed checkpoint in ``load_dir`` (layout may differ)."""
        cfg = self.config
        names = SHARDED_ENTRIES if cfg.load_optimizer_states else ("model",)
        with self._whole():  # ZeRO-3: DCP loads into the gathered parameters
            loaded = ckpt.load_checkpoint(
                load_dir,
                self._sharded(names),
                self.topology,
                fallback_to_previous=cfg.fallback_to_previous_checkpoint,
                allowed_missing=cfg.allowed_missing_keys_in_checkpoint,
                allowed_unexpected=cfg.allowed_unexpected_keys_in_checkpoint,
                # Without optimizer states the checkpoint's optimizer keys are simply not read.
                ignored=[*cfg.ignore_keys_in_checkpoint, *([] if cfg.load_optimizer_states else [r"optimizer\..*"])],
                aliases=model.tied_copies if isinstance(model := self.states.get("model"), ModelState) else None,
            )
            # The optimizer's master weights / ZeRO-3 shards start from the loaded parameters
            # (its own state, loaded next, overrides them where it has them).
            self.states["model"].load_state_dict(loaded.state["model"])
        if "optimizer" in names and "optimizer" in self.states:
            self.states["optimizer"].load_state_dict(loaded.state["optimizer"])
        extra = loaded.extra
        if cfg.load_context:
            for name in self._extra_names():
                self.states[name].load_state_dict(extra[name])
            rank = self.states.get(RANK_ENTRY)
            if (
                rank is not None
                and extra.get("world_size") == self.topology.world_size
                and loaded.rank_state is not None
            ):
                rank.load_state_dict(loaded.rank_state)
        self.last_loaded_step = loaded.step
        self._console(f"loaded checkpoint step {loaded.step} from {loaded.path}")
