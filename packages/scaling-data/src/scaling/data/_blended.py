"""BlendedDataset: a weighted interleaving of several datasets, indexed deterministically."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from scaling.data._base import BaseDataset, BatchT, ItemT
from scaling.data._weights import explicit_weights

_INDEX_VERSION = 1


def build_blend_index(
    weights: np.ndarray, sizes: Sequence[int], num_samples: int, seed: int, shuffle: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """``(dataset_index, sample_index)`` of a blend of ``num_samples`` samples.

    Source ``d``'s ``k``-th pick is placed at time ``(k + 0.5) / w_d`` and all picks are
    merged by time (ties by source), so every prefix of length ``m`` holds within one
    sample of ``w_d * m`` from each source. Within a source, picks walk seeded
    permutations (one per pass over it, from ``(seed, d, pass)``).
    """
    ids, ranks, times = [], [], []
    for d, w in enumerate(weights):
        if w <= 0:
            continue
        count = int(np.floor(w * num_samples)) + 2
        k = np.arange(count, dtype=np.int64)
        ids.append(np.full(count, d, dtype=np.int32))
        ranks.append(k)
        times.append((k + 0.5) / w)
    all_ids, all_ranks = np.concatenate(ids), np.concatenate(ranks)
    order = np.lexsort((all_ids, np.concatenate(times)))[:num_samples]
    dataset_index, pick_rank = all_ids[order], all_ranks[order]
    sample_index = np.empty(num_samples, dtype=np.int64)
    for d in np.unique(dataset_index):
        mask = dataset_index == d
        ks = pick_rank[mask]
        n = int(sizes[d])
        passes = int(ks.max()) // n + 1
        if shuffle:
            walk = np.concatenate([np.random.default_rng([seed, int(d), p]).permutation(n) for p in range(passes)])
        else:
            walk = np.tile(np.arange(n), passes)
        sample_index[mask] = walk[ks]
    return dataset_index, sample_index


class BlendedDataset(BaseDataset[ItemT, BatchT]):
    """``num_samples`` samples drawn from several datasets in proportion to ``weights``.

    The interleaving is a deterministic function of (datasets, weights, num_samples,
    seed): the same seed gives the same order. With ``cache_dir`` the index is saved as
    ``blend-<hash>.npz`` and loaded on the next run (written atomically, so concurrent
    ranks may share the directory). Batches are collated by the first dataset.

    Args:
        datasets: the sources (they must produce items the first one can collate).
        weights: one non-negative weight per source, normalised; see
            :func:`weights_by_size`, :func:`examples_proportional_weights`, :class:`BlendConfig`.
        num_samples: length of the blend (sources repeat or are subsampled to fit).
        seed: seed of each source's sample order (the DataLoader resets it via ``set_seed``).
        cache_dir: directory for the index cache; ``None`` = build in memory.

    Raises:
        ValueError: on an empty source list, mismatched weights or ``num_samples < 1``.
    """

    def __init__(
        self,
        datasets: Sequence[BaseDataset[ItemT, BatchT]],
        weights: Sequence[float],
        num_samples: int,
        seed: int = 0,
        cache_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if not datasets:
            raise ValueError("BlendedDataset: datasets is empty; pass at least one dataset")
        if len(weights) != len(datasets):
            raise ValueError(
                f"BlendedDataset: {len(weights)} weights for {len(datasets)} datasets; give one weight per dataset"
            )
        if num_samples < 1:
            raise ValueError(f"BlendedDataset: num_samples={num_samples} must be >= 1")
        self.datasets = list(datasets)
        self.weights = explicit_weights(weights)
        self.sizes = [len(ds) for ds in self.datasets]
        empty = [ds.ident() for ds, n, w in zip(self.datasets, self.sizes, self.weights) if n == 0 and w > 0]
        if empty:
            raise ValueError(f"BlendedDataset: datasets {empty} are empty but have a positive weight")
        self.num_samples = num_samples
        self.cache_dir = None if cache_dir is None else Path(cache_dir)
        self.seed, self.shuffle = seed, True
        self._index: tuple[np.ndarray, np.ndarray] | None = None

    def ident(self) -> str:
        parts = ",".join(f"{ds.ident()}@{w:.6g}" for ds, w in zip(self.datasets, self.weights))
        return f"blend[{parts}]:n{self.num_samples}"

    def set_seed(self, seed: int, shuffle: bool = True) -> None:
        """Re-seed the per-source order (and each source); builds or loads the index now."""
        if (seed, shuffle) != (self.seed, self.shuffle):
            self._index = None
        super().set_seed(seed, shuffle)
        for ds in self.datasets:
            ds.set_seed(seed, shuffle)
        self._ensure_index()

    def _cache_path(self) -> Path | None:
        if self.cache_dir is None:
            return None
        key = {
            "v": _INDEX_VERSION,
            "sources": [ds.ident() for ds in self.datasets],
            "sizes": self.sizes,
            "weights": [float(w) for w in self.weights],
            "num_samples": self.num_samples,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
        return self.cache_dir / f"blend-{digest}.npz"

    def _ensure_index(self) -> tuple[np.ndarray, np.ndarray]:
        if self._index is not None:
            return self._index
        path = self._cache_path()
        if path is not None and path.is_file():
            with np.load(path) as f:
                index = (f["dataset_index"], f["sample_index"])
            if len(index[0]) == len(index[1]) == self.num_samples:
                self._index = index
                return index
        index = build_blend_index(self.weights, self.sizes, self.num_samples, self.seed, self.shuffle)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                np.savez(f, dataset_index=index[0], sample_index=index[1])
            os.replace(tmp, path)
        self._index = index
        return index

    @property
    def dataset_index(self) -> np.ndarray:
        """Source of every sample."""
        return self._ensure_index()[0]

    @property
    def sample_index(self) -> np.ndarray:
        """Index inside its source of every sample."""
        return self._ensure_index()[1]

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> ItemT:
        dataset_index, sample_index = self._ensure_index()
        return self.datasets[int(dataset_index[index])][int(sample_index[index])]

    def collate(self, items: list[ItemT]) -> BatchT:
        return self.datasets[0].collate(items)
