import importlib
import pathlib

import scaling.data


def test_public_api():
    assert sorted(scaling.data.__all__) == [
        "BaseDataset",
        "BaseDatasetBatch",
        "BaseDatasetItem",
        "BlendConfig",
        "BlendedDataset",
        "DataLoader",
        "GlobalBatchSampler",
        "GlobalSampleOrder",
        "LMPackingBatch",
        "LMPackingDataset",
        "LMPackingItem",
        "MMapTokenBuilder",
        "MMapTokenDataset",
        "TokenFileError",
        "build_blend_index",
        "examples_proportional_weights",
        "explicit_weights",
        "load_tokenizer",
        "segment_positions",
        "stack_windows",
        "tokenize_files",
        "weights_by_size",
    ]
    for name in scaling.data.__all__:
        assert getattr(scaling.data, name).__doc__, f"{name} has no docstring"


def test_namespace_package_has_no_init():
    import scaling

    assert all(not (pathlib.Path(p) / "__init__.py").exists() for p in scaling.__path__)
    assert importlib.import_module("scaling.data._cli").main.__doc__


def test_base_classes_enforce_the_contract():
    import pytest

    class Incomplete(scaling.data.BaseDataset):
        def ident(self):
            return "x"

    with pytest.raises(TypeError, match="abstract"):
        Incomplete()


def test_plain_class_batch_moves_and_pins_like_a_dataclass():
    import torch

    class PlainBatch(scaling.data.BaseDatasetBatch):  # the walkthrough's style: no @dataclass
        def __init__(self, inputs, targets):
            self.inputs, self.targets, self.note = inputs, targets, "kept"

        def only_inputs(self):
            return self

        def only_targets(self):
            return self

    batch = PlainBatch(torch.ones(2, 3), torch.arange(2))
    moved = batch.to("cpu")
    assert moved is not batch and moved.note == "kept" and torch.equal(moved.targets, batch.targets)
    meta = batch.to("meta")
    assert meta.inputs.device.type == "meta" and batch.inputs.device.type == "cpu"
