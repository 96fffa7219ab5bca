"""DataLoader: DP-sharded, seeded, infinite and resumable in global-sample space."""

from __future__ import annotations

from collections.abc import Collection, Iterator
from typing import TYPE_CHECKING, Any, Generic

import torch
import torch.utils.data

from scaling.data._base import BaseDataset, BatchT
from scaling.data._sampler import GlobalBatchSampler

if TYPE_CHECKING:
    from scaling.config import StateDict
    from scaling.topology import Topology

_BATCH_ARGS = ("global_batch_size", "micro_batch_size", "data_parallel_rank", "data_parallel_size")


class DataLoader(Generic[BatchT]):
    """Iterate one DP rank's micro-batches of a :class:`BaseDataset`, forever.

    Every step takes the next ``global_batch_size`` samples of one global stream
    (seeded per-epoch permutations); DP rank ``d`` gets its contiguous slice, split into
    ``gradient_accumulation_steps`` micro-batches. The state is ``(seed,
    consumed_samples)``: a run resumed from :meth:`state_dict` with another DP size or
    micro-batch size continues the same stream, with no sample skipped or repeated.
    Workers, pinned memory and prefetching are ``torch.utils.data.DataLoader``'s.

    Give the sizes either through ``topology`` (its config's batch sizes and this rank's
    DP coordinate) or explicitly through the four keyword arguments, not both.

    Args:
        dataset: the dataset; its ``collate`` builds each micro-batch.
        seed: seed of the sample order; also passed to ``dataset.set_seed``.
        topology: this rank's topology (need not be initialised for the order itself).
        global_batch_size: samples per optimizer step over all DP ranks.
        micro_batch_size: samples per micro-batch.
        data_parallel_rank: this rank's DP coordinate.
        data_parallel_size: number of DP ranks.
        consumed_samples: stream position to start at (as in :meth:`state_dict`).
        shuffle: permute every epoch; ``False`` reads ``0..n-1`` in order.
        num_workers: worker processes of the underlying torch loader.
        pin_memory: pin host memory of the batches (for fast host-to-device copies).
        prefetch_factor: micro-batches prefetched per worker (needs ``num_workers > 0``).
        persistent_workers: keep workers alive across iterator restarts.
        read_on_model_parallel_rank_zero_only: with a topology and TP > 1, only TP rank 0
            reads data; the other TP ranks get ``None`` for every micro-batch and receive
            the batch through ``dataset.sync_batch_to_model_parallel``. With a topology, the
            pipeline stages not in ``reading_stages`` read nothing either: ``None`` for every
            micro-batch, the stream position advancing as on every rank.
        reading_stages: the pipeline stages that read batches (the first one feeds the model,
            the one that computes the loss takes the targets); default: the first and the last.
            Under ZB-V's V placement the loss is on the first stage: ``(0,)``.

    Example::

        loader = DataLoader(dataset, seed=42, topology=topology)
        micro_batches = loader.next_step()  # this rank's micro-batches of one optimizer step
        checkpoint = loader.state_dict()    # {"seed": 42, "consumed_samples": ..., ...}

    Raises:
        ValueError: when sizes are missing, given twice, or inconsistent.
    """

    def __init__(
        self,
        dataset: BaseDataset[Any, BatchT],  # Any: the loader never sees an item, only batches
        *,
        seed: int,
        topology: Topology | None = None,
        global_batch_size: int | None = None,
        micro_batch_size: int | None = None,
        data_parallel_rank: int | None = None,
        data_parallel_size: int | None = None,
        consumed_samples: int = 0,
        shuffle: bool = True,
        num_workers: int = 0,
        pin_memory: bool = False,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        read_on_model_parallel_rank_zero_only: bool = True,
        reading_stages: Collection[int] | None = None,
    ) -> None:
        explicit = dict(zip(_BATCH_ARGS, (global_batch_size, micro_batch_size, data_parallel_rank, data_parallel_size)))
        if topology is not None:
            given = [k for k, v in explicit.items() if v is not None]
            if given:
                raise ValueError(
                    f"DataLoader: {given} given together with topology; the topology already fixes them, "
                    "pass either topology or the four sizes"
                )
            cfg = topology.config
            explicit = dict(
                zip(
                    _BATCH_ARGS,
                    (
                        cfg.global_batch_size,
                        cfg.micro_batch_size,
                        topology.axis("dp").rank,
                        topology.axis("dp").size,
                    ),
                )
            )
        missing = [k for k, v in explicit.items() if v is None]
        if missing:
            raise ValueError(
                f"DataLoader: {missing} not set; pass topology= (with global_batch_size and micro_batch_size in its "
                "config) or all of global_batch_size, micro_batch_size, data_parallel_rank, data_parallel_size"
            )
        if prefetch_factor is not None and num_workers == 0:
            raise ValueError(f"DataLoader: prefetch_factor={prefetch_factor} needs num_workers > 0, got num_workers=0")
        self.dataset = dataset
        self.topology = topology
        self.shuffle = shuffle
        self._sizes: dict[str, int] = explicit  # type: ignore[assignment]
        self._num_workers, self._pin_memory, self._prefetch_factor = num_workers, pin_memory, prefetch_factor
        self._persistent_workers = persistent_workers and num_workers > 0
        # A middle pipeline stage never reads a batch (its input is the previous stage's
        # activations); neither does a TP rank other than 0 when TP rank 0 broadcasts.
        tp, pp = (None, None) if topology is None else (topology.axis("tp"), topology.axis("pp"))
        readers = {0, pp.size - 1} if pp is not None and reading_stages is None else set(reading_stages or ())
        self._skip_reading = (tp is not None and read_on_model_parallel_rank_zero_only and tp.rank != 0) or (
            pp is not None and pp.rank not in readers
        )
        self._reset(seed, consumed_samples)

    def _reset(self, seed: int, consumed_samples: int) -> None:
        self.sampler = GlobalBatchSampler(
            num_samples=len(self.dataset),
            seed=seed,
            consumed_samples=consumed_samples,
            shuffle=self.shuffle,
            **self._sizes,
        )
        self.seed = seed
        self._consumed_samples = consumed_samples
        self._micro_batches_in_step = 0
        self._iterator: Iterator[BatchT] | None = None
        self.dataset.set_seed(seed, shuffle=self.shuffle)
        self._torch_loader = torch.utils.data.DataLoader(
            self.dataset,
            batch_sampler=self.sampler,
            collate_fn=self.dataset.collate,
            # Worker seeds derive from this generator, so worker-side randomness is reproducible too.
            generator=torch.Generator().manual_seed(seed),
            num_workers=self._num_workers,
            pin_memory=self._pin_memory,
            prefetch_factor=self._prefetch_factor,
            persistent_workers=self._persistent_workers,
        )

    # ----------------------------------------------------------------- sizes
    @property
    def global_batch_size(self) -> int:
        return self.sampler.global_batch_size

    @property
    def micro_batch_size(self) -> int:
        return self.sampler.micro_batch_size

    @property
    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step on this DP rank."""
        return self.sampler.gradient_accumulation_steps

    @property
    def consumed_samples(self) -> int:
        """Global samples (all DP ranks) of the completed steps."""
        return self._consumed_samples

    # ------------------------------------------------------------- iteration
    def __iter__(self) -> DataLoader[BatchT]:
        return self

    def __next__(self) -> BatchT | None:
        """The next micro-batch of this DP rank (``None`` on TP ranks that do not read)."""
        if self._skip_reading:
            batch: BatchT | None = None
        else:
            if self._iterator is None:
                self._iterator = iter(self._torch_loader)
            batch = next(self._iterator)
        self._micro_batches_in_step += 1
        if self._micro_batches_in_step == self.gradient_accumulation_steps:
            self._micro_batches_in_step = 0
            self._consumed_samples += self.global_batch_size
        return batch

    def next_step(self) -> list[BatchT | None]:
        """This rank's ``gradient_accumulation_steps`` micro-batches of the next optimizer step.

        Raises:
            RuntimeError: when single micro-batches were drawn with ``next()`` mid-step.
        """
        self._require_step_boundary("next_step()")
        return [next(self) for _ in range(self.gradient_accumulation_steps)]

    def _require_step_boundary(self, what: str) -> None:
        if self._micro_batches_in_step:
            raise RuntimeError(
                f"DataLoader.{what} at micro-batch {self._micro_batches_in_step} of "
                f"{self.gradient_accumulation_steps} of a step; draw the rest of the step first"
            )

    # ------------------------------------------------------------- state
    def state_dict(self) -> StateDict:
        """``{"seed", "consumed_samples", "global_batch_size", "dataset_ident", "num_samples"}`` at a step boundary.

        Raises:
            RuntimeError: in the middle of a step (checkpoint between optimizer steps).
        """
        self._require_step_boundary("state_dict()")
        return {
            "seed": self.seed,
            "consumed_samples": self._consumed_samples,
            "global_batch_size": self.global_batch_size,
            "dataset_ident": self.dataset.ident(),
            "num_samples": len(self.dataset),
        }

    def load_state_dict(self, state: StateDict, strict: bool = True) -> None:
        """Continue the stream of ``state``; prefetched micro-batches are dropped.

        Args:
            state: from :meth:`state_dict` (possibly saved with another DP or micro-batch size).
            strict: require the same dataset (ident and length) as at save time.

        Raises:
            ValueError: when ``strict`` and the dataset differs, or a key is missing.
        """
        missing = [k for k in ("seed", "consumed_samples") if k not in state]
        if missing:
            raise ValueError(f"DataLoader.load_state_dict: state lacks {missing}; pass DataLoader.state_dict() output")
        if strict:
            now = {"dataset_ident": self.dataset.ident(), "num_samples": len(self.dataset)}
            for key, value in now.items():
                if key in state and state[key] != value:
                    raise ValueError(
                        f"DataLoader.load_state_dict: {key}={state[key]!r} in the checkpoint but {value!r} now; "
                        "resume on the same dataset, or pass strict=False to continue the stream anyway"
                    )
        self._reset(int(state["seed"]), int(state["consumed_samples"]))

    def __repr__(self) -> str:
        s = self._sizes
        return (
            f"DataLoader({self.dataset.ident()!r}, seed={self.seed}, consumed_samples={self._consumed_samples}, "
            f"global_batch_size={s['global_batch_size']}, micro_batch_size={s['micro_batch_size']}, "
            f"dp={s['data_parallel_rank']}/{s['data_parallel_size']})"
        )
