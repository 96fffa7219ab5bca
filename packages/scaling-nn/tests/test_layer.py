from dataclasses import dataclass

import pytest
import torch

from scaling.nn import (
    BaseLayer,
    ColumnParallelLinear,
    LayerSpec,
    ParameterMeta,
    RowParallelLinear,
    TiedLayerSpec,
    VocabParallelEmbedding,
    attach_parameter_metas,
    get_parameter_meta,
    named_parameters_with_meta,
    set_layer_index,
)


@dataclass
class IO:
    activations: torch.Tensor


class Block(BaseLayer[IO, IO]):
    def __init__(self, in_features: int, out_features: int, topology=None, scale: float = 1.0):
        super().__init__()
        self.linear = ColumnParallelLinear(in_features=in_features, out_features=out_features, topology=topology)
        self.proj = RowParallelLinear(in_features=out_features, out_features=in_features, topology=topology)
        self.extra = torch.nn.Linear(in_features, 2)  # a plain torch module gets a replicated meta
        self.scale = scale

    def forward(self, x: IO) -> IO:
        return IO(activations=self.scale * self.proj(torch.relu(self.linear(x.activations))))


class Embed(BaseLayer[IO, IO]):
    def __init__(self, vocab: int, dim: int, topology=None):
        super().__init__()
        self.embedding = VocabParallelEmbedding(vocab, dim, topology=topology)

    def forward(self, x: IO) -> IO:
        return IO(activations=self.embedding(x.activations))


def test_layerspec_builds_module_with_local_names_and_metas():
    spec = LayerSpec(module_class=Block, topology=None, in_features=4, out_features=6)
    layer = spec.initialize(scale=2.0)
    assert layer.scale == 2.0
    metas = {n: m for n, _, m in named_parameters_with_meta(layer)}
    assert sorted(metas) == sorted(n for n, _ in layer.named_parameters())
    assert all(m.local_name == n for n, m in metas.items())
    assert metas["linear.weight"].parallel_dim == 0 and metas["linear.weight"].logical_shape == (6, 4)
    assert metas["proj.weight"].parallel_dim == 1 and metas["proj.bias"].parallel_dim is None
    assert metas["extra.weight"] == ParameterMeta("extra.weight", (2, 4))
    out = layer(IO(activations=torch.randn(3, 4)))
    assert out.activations.shape == (3, 4)
    assert "Block" in repr(spec) and "in_features=4" in repr(spec)


def test_set_layer_index_gives_layout_independent_keys():
    layer = set_layer_index(LayerSpec(Block, in_features=4, out_features=6).initialize(), 3)
    keys = sorted(m.key for _, _, m in named_parameters_with_meta(layer))
    assert keys[0] == "layers.3.extra.bias" and "layers.3.linear.weight" in keys
    attach_parameter_metas(layer)  # idempotent: keeps the index
    assert get_parameter_meta(layer.linear.weight).key == "layers.3.linear.weight"


def test_tied_layer_spec_marks_tied_parameters():
    spec = TiedLayerSpec("embedding", ["embedding.weight"], Embed, vocab=11, dim=4)
    layer = spec.initialize()
    assert get_parameter_meta(layer.embedding.weight).tied_key == "embedding"
    assert spec.key == "embedding" and spec.tied_weight_attributes == ["embedding.weight"]


def test_layer_spec_rejects_non_module():
    with pytest.raises(TypeError, match=r"module_class must be a torch.nn.Module subclass"):
        LayerSpec(module_class=int)


def test_tied_layer_spec_errors_name_the_parameters():
    with pytest.raises(
        ValueError, match=r"'embedding.bias' not found on Embed; its parameters are \['embedding.weight'\]"
    ):
        TiedLayerSpec("e", ["embedding.bias"], Embed, vocab=5, dim=2).initialize()
    with pytest.raises(ValueError, match=r"key must be a non-empty string, got ''"):
        TiedLayerSpec("", ["embedding.weight"], Embed, vocab=5, dim=2)
    with pytest.raises(ValueError, match=r"tied_weight_attributes is empty"):
        TiedLayerSpec("e", [], Embed, vocab=5, dim=2)
    with pytest.raises(ValueError, match=r"'embedding' is a VocabParallelEmbedding, not a parameter"):
        TiedLayerSpec("e", ["embedding"], Embed, vocab=5, dim=2).initialize()


def test_named_parameters_with_meta_requires_meta():
    with pytest.raises(ValueError, match=r"has no ParameterMeta"):
        list(named_parameters_with_meta(torch.nn.Linear(2, 2)))


def test_base_layer_is_abstract():
    with pytest.raises(TypeError, match=r"abstract"):
        BaseLayer()


def test_base_layer_takes_the_original_librarys_three_type_parameters():
    from scaling.nn import LayerInputError

    @dataclass
    class IO:
        activations: torch.Tensor

    class Last(BaseLayer[IO, IO, IO]):  # input, output, last-layer output
        def __init__(self) -> None:
            super().__init__()
            self.linear = ColumnParallelLinear(4, 2)

        def forward(self, x: IO) -> IO:
            return IO(self.linear(x.activations))

    assert Last()(IO(torch.ones(3, 4))).activations.shape == (3, 2)
    with pytest.raises(TypeError, match="Too many arguments"):
        BaseLayer[IO, IO, IO, IO]
    with pytest.raises(LayerInputError, match=r"ColumnParallelLinear\(4 -> 2\) got an input of shape \[3, 5\]"):
        Last()(IO(torch.ones(3, 5)))
