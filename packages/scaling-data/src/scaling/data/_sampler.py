"""The sample order, in global-sample space.

Sample positions ``0, 1, 2, ...`` enumerate an infinite stream: epoch ``e`` is a
permutation of ``range(num_samples)`` drawn with numpy from ``seed + e`` (or the
identity without shuffling), and position ``p`` is sample ``order(p // n)[p % n]``.
Step ``t`` consumes positions ``[t * G, (t + 1) * G)`` (``G`` = global batch size);
DP rank ``d`` takes the contiguous slice ``[d * G / dp, (d + 1) * G / dp)`` of it and
splits that into micro-batches. The whole state is ``(seed, consumed_samples)``, so a
run resumed with another DP size or micro-batch size (same ``G``, or any ``G`` at a
step boundary) continues the same stream: nothing is skipped or repeated.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np


def _check_int(name: str, value: int, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum}")
    return int(value)


class GlobalSampleOrder:
    """The infinite, seeded stream of sample indices (epoch permutations laid end to end).

    Args:
        num_samples: length of the dataset (> 0).
        seed: epoch ``e`` is ``numpy.random.default_rng(seed + e).permutation(num_samples)``.
        shuffle: ``False`` gives ``0, 1, ..., n-1`` every epoch.
    """

    def __init__(self, num_samples: int, seed: int, shuffle: bool = True) -> None:
        self.num_samples = _check_int("num_samples (len(dataset))", num_samples, 1)
        self.seed = _check_int("seed", seed, 0)
        self.shuffle = shuffle
        self._epoch = -1
        self._order: np.ndarray = np.empty(0, dtype=np.int64)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The sample indices of ``epoch`` (cached: consecutive calls are cheap)."""
        if epoch != self._epoch:
            dtype = np.int32 if self.num_samples < 2**31 else np.int64
            if self.shuffle:
                order = np.random.default_rng(self.seed + epoch).permutation(self.num_samples).astype(dtype)
            else:
                order = np.arange(self.num_samples, dtype=dtype)
            self._epoch, self._order = epoch, order
        return self._order

    def positions(self, start: int, stop: int) -> np.ndarray:
        """Sample indices at stream positions ``[start, stop)`` (may cross epochs)."""
        parts = []
        pos = start
        while pos < stop:
            epoch, offset = divmod(pos, self.num_samples)
            take = min(stop - pos, self.num_samples - offset)
            parts.append(self.epoch_order(epoch)[offset : offset + take])
            pos += take
        if not parts:
            return np.empty(0, dtype=np.int64)
        return np.concatenate(parts).astype(np.int64, copy=False)

    def global_batch(self, consumed_samples: int, global_batch_size: int) -> np.ndarray:
        """The sample indices of the global batch that starts after ``consumed_samples``."""
        return self.positions(consumed_samples, consumed_samples + global_batch_size)


class GlobalBatchSampler:
    """Yields this DP rank's micro-batches (lists of sample indices), forever.

    A ``batch_sampler`` for ``torch.utils.data.DataLoader``: each step it takes the next
    global batch of the stream, keeps this rank's contiguous slice and yields it in
    ``gradient_accumulation_steps`` micro-batches of ``micro_batch_size``.

    Args:
        num_samples: length of the dataset.
        global_batch_size: samples per optimizer step over all DP ranks.
        micro_batch_size: samples per micro-batch on one DP rank.
        data_parallel_rank: this rank's DP coordinate.
        data_parallel_size: number of DP ranks.
        seed: seed of the epoch permutations.
        consumed_samples: stream position to start at (a multiple of the global batch
            size when resuming at a step boundary).
        shuffle: shuffle each epoch.

    Raises:
        ValueError: when the sizes do not satisfy
            ``global_batch_size = micro_batch_size * accumulation * data_parallel_size``.
    """

    def __init__(
        self,
        num_samples: int,
        global_batch_size: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        seed: int,
        consumed_samples: int = 0,
        shuffle: bool = True,
    ) -> None:
        self.global_batch_size = _check_int("global_batch_size", global_batch_size, 1)
        self.micro_batch_size = _check_int("micro_batch_size", micro_batch_size, 1)
        self.data_parallel_size = _check_int("data_parallel_size", data_parallel_size, 1)
        self.data_parallel_rank = _check_int("data_parallel_rank", data_parallel_rank, 0)
        self.consumed_samples = _check_int("consumed_samples", consumed_samples, 0)
        if self.data_parallel_rank >= self.data_parallel_size:
            raise ValueError(
                f"data_parallel_rank={data_parallel_rank} is outside [0, data_parallel_size={data_parallel_size})"
            )
        per_rank, rem = divmod(self.global_batch_size, self.data_parallel_size * self.micro_batch_size)
        if rem != 0 or per_rank == 0:
            raise ValueError(
                f"global_batch_size={global_batch_size} is not a multiple of micro_batch_size={micro_batch_size} "
                f"× data_parallel_size={data_parallel_size}; choose a global batch size that is, e.g. "
                f"{self.micro_batch_size * self.data_parallel_size * max(per_rank, 1)}"
            )
        self.gradient_accumulation_steps = per_rank
        self.order = GlobalSampleOrder(num_samples, seed, shuffle)

    @property
    def local_batch_size(self) -> int:
        """Samples per step on this DP rank."""
        return self.global_batch_size // self.data_parallel_size

    def local_batch(self, consumed_samples: int) -> np.ndarray:
        """This rank's slice of the global batch starting at ``consumed_samples``."""
        start = consumed_samples + self.data_parallel_rank * self.local_batch_size
        return self.order.positions(start, start + self.local_batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        # A fresh iteration starts at the position given at construction; the DataLoader
        # counts what was delivered (prefetching runs ahead of the consumer).
        consumed = self.consumed_samples
        while True:
            local = self.local_batch(consumed).tolist()
            for m in range(self.gradient_accumulation_steps):
                yield local[m * self.micro_batch_size : (m + 1) * self.micro_batch_size]
            consumed += self.global_batch_size
