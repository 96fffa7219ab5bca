import numpy as np
import pytest
import torch

from scaling.data import (
    BaseDataset,
    BlendConfig,
    BlendedDataset,
    DataLoader,
    examples_proportional_weights,
    explicit_weights,
    weights_by_size,
)


class Source(BaseDataset[tuple, torch.Tensor]):
    def __init__(self, name, n):
        self.name, self.n = name, n

    def ident(self):
        return f"src-{self.name}-{self.n}"

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        return (self.name, int(index))

    def collate(self, items):
        return items


def sources():
    return [Source(0, 1000), Source(1, 37), Source(2, 5000), Source(3, 400)]


def test_weight_functions():
    np.testing.assert_allclose(explicit_weights([2, 1, 1]), [0.5, 0.25, 0.25])
    np.testing.assert_allclose(weights_by_size([100, 300], power=1.0), [0.25, 0.75])
    np.testing.assert_allclose(weights_by_size([100, 400], power=0.5), [1 / 3, 2 / 3])
    np.testing.assert_allclose(weights_by_size([100, 400], power=0.0), [0.5, 0.5])
    np.testing.assert_allclose(examples_proportional_weights([100, 10_000], cap=300), [0.25, 0.75])
    np.testing.assert_allclose(examples_proportional_weights([100, 400], temperature=2.0), [1 / 3, 2 / 3])
    cfg = BlendConfig(weighting="examples_proportional", cap=300)
    np.testing.assert_allclose(cfg.resolve([100, 10_000]), [0.25, 0.75])
    np.testing.assert_allclose(BlendConfig(weights=[1, 3]).resolve([5, 5]), [0.25, 0.75])


@pytest.mark.parametrize("weights", [[0.5, 0.1, 0.3, 0.1], [0.01, 0.02, 0.9, 0.07], [1, 0, 0, 1]])
def test_frequencies_match_weights_over_100k(weights):
    blend = BlendedDataset(sources(), weights, num_samples=100_000, seed=3)
    counts = np.bincount(blend.dataset_index, minlength=4) / 100_000
    w = np.asarray(weights) / np.sum(weights)
    assert np.all(np.abs(counts - w) <= 0.01 * w + 1e-12), (counts, w)
    # also on every prefix: within one sample per source
    prefix = blend.dataset_index[:12_345]
    assert np.all(np.abs(np.bincount(prefix, minlength=4) - w * 12_345) <= 1.0)


def test_sources_walk_permutations_and_seed_decides_order():
    a = BlendedDataset(sources(), [1, 1, 1, 1], num_samples=400, seed=1)
    b = BlendedDataset(sources(), [1, 1, 1, 1], num_samples=400, seed=1)
    c = BlendedDataset(sources(), [1, 1, 1, 1], num_samples=400, seed=2)
    assert [a[i] for i in range(400)] == [b[i] for i in range(400)]
    assert [a[i] for i in range(400)] != [c[i] for i in range(400)]
    picks = a.sample_index[a.dataset_index == 1].tolist()  # 100 picks of a 37-sample source, in order
    assert sorted(picks[:37]) == sorted(picks[37:74]) == list(range(37))  # whole passes before repeats
    assert picks[:37] != picks[37:74]  # each pass has its own permutation


def test_cache_round_trip(tmp_path):
    a = BlendedDataset(sources(), [0.2, 0.3, 0.4, 0.1], num_samples=5000, seed=4, cache_dir=tmp_path)
    ref = (a.dataset_index.copy(), a.sample_index.copy())
    files = list(tmp_path.glob("blend-*.npz"))
    assert len(files) == 1
    b = BlendedDataset(sources(), [0.2, 0.3, 0.4, 0.1], num_samples=5000, seed=4, cache_dir=tmp_path)
    np.testing.assert_array_equal(b.dataset_index, ref[0])
    np.testing.assert_array_equal(b.sample_index, ref[1])
    b.set_seed(5)
    assert len(list(tmp_path.glob("blend-*.npz"))) == 2  # another seed, another cache entry
    assert not np.array_equal(b.sample_index, ref[1])


def test_loader_over_blend_is_seeded():
    blend = BlendedDataset(sources(), [1, 2, 3, 4], num_samples=1000)
    loader = DataLoader(
        blend, seed=11, global_batch_size=8, micro_batch_size=4, data_parallel_rank=0, data_parallel_size=1
    )
    first = loader.next_step()
    again = DataLoader(
        BlendedDataset(sources(), [1, 2, 3, 4], num_samples=1000),
        seed=11,
        global_batch_size=8,
        micro_batch_size=4,
        data_parallel_rank=0,
        data_parallel_size=1,
    ).next_step()
    assert first == again and len(first[0]) == 4


def test_errors():
    with pytest.raises(ValueError, match=r"3 weights for 4 datasets"):
        BlendedDataset(sources(), [1, 1, 1], num_samples=10)
    with pytest.raises(ValueError, match=r"weights must be finite and >= 0, got \[1.0, -1.0, 1.0, 1.0\]"):
        BlendedDataset(sources(), [1, -1, 1, 1], num_samples=10)
    with pytest.raises(ValueError, match=r"weights sum to 0.0"):
        explicit_weights([0, 0])
    with pytest.raises(ValueError, match=r"datasets \['src-9-0'\] are empty but have a positive weight"):
        BlendedDataset([Source(1, 3), Source(9, 0)], [1, 1], num_samples=10)
    with pytest.raises(ValueError, match=r"num_samples=0 must be >= 1"):
        BlendedDataset(sources(), [1, 1, 1, 1], num_samples=0)
    with pytest.raises(ValueError, match=r"datasets is empty"):
        BlendedDataset([], [], num_samples=1)
    with pytest.raises(ValueError, match=r"cap=0 must be >= 1"):
        examples_proportional_weights([1, 2], cap=0)
    with pytest.raises(ValueError, match=r"temperature=0 must be > 0"):
        examples_proportional_weights([1, 2], temperature=0)
    with pytest.raises(ValueError, match=r"power=-1 must be >= 0"):
        weights_by_size([1, 2], power=-1)
    with pytest.raises(
        ValueError, match=r"weighting='explicit' needs one weight per dataset: 2 datasets, weights has None"
    ):
        BlendConfig().resolve([1, 2])
    with pytest.raises(ValueError, match=r"temperature"):
        BlendConfig(weighting="examples_proportional", temperature=0)
