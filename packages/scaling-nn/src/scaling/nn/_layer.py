"""BaseLayer, LayerSpec and TiedLayerSpec: how a model is declared as a list of layers.

A layer takes one LayerIO dataclass (a dataclass whose fields are tensors or None) and
returns another. The pipeline builds only its stage's layers from their specs, so a spec
holds the class and arguments, never a built module.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from dataclasses import replace
from typing import Generic, TypeVar

import torch

from scaling.nn._meta import ParameterMeta, get_parameter_meta

Input = TypeVar("Input")
Output = TypeVar("Output")


class BaseLayer(torch.nn.Module, Generic[Input, Output], abc.ABC):
    """A layer of a Scaling model: one LayerIO dataclass in, one out.

    ``BaseLayer[Input, Output]``; the original library's ``BaseLayer[Input, Output,
    LastLayerOutput]`` is accepted too (the third parameter is ignored). Subclasses
    implement :meth:`forward`. Inputs and outputs are dataclasses of tensors
    ("LayerIO"); the first layer receives ``batch.only_inputs()``, each later layer the
    previous layer's output, and the loss function the last layer's output.

    Example::

        @dataclass
        class MLPLayerIO:
            activations: torch.Tensor

        class Block(BaseLayer[MLPLayerIO, MLPLayerIO]):
            def __init__(self, in_features, out_features, topology=None):
                super().__init__()
                self.linear = ColumnParallelLinear(in_features, out_features, topology=topology)

            def forward(self, x: MLPLayerIO) -> MLPLayerIO:
                return MLPLayerIO(activations=torch.relu(self.linear(x.activations)))
    """

    def __class_getitem__(cls, params: object) -> object:
        # The original library wrote BaseLayer[Input, Output, LastLayerOutput]; the third
        # parameter (what the last layer returns) is accepted and carries no meaning here.
        if isinstance(params, tuple) and len(params) == 3:
            params = params[:2]
        return super().__class_getitem__(params)  # type: ignore[misc]

    @abc.abstractmethod
    def forward(self, x: Input) -> Output:
        """Map the input LayerIO to the output LayerIO."""


def attach_parameter_metas(module: torch.nn.Module) -> torch.nn.Module:
    """Give every parameter of ``module`` a meta whose ``local_name`` is its name in ``module``.

    Parameters created by Scaling layers keep their split information (only the local name
    is rewritten, e.g. ``weight`` -> ``linear.weight``); parameters of plain torch modules
    get a replicated meta. Idempotent. Returns ``module``.
    """
    for name, param in module.named_parameters(remove_duplicate=False):
        meta = getattr(param, "parameter_meta", None)
        if meta is None:
            meta = ParameterMeta(local_name=name, logical_shape=tuple(param.shape))
        elif meta.local_name != name:
            meta = replace(meta, local_name=name)
        meta.attach(param)
    return module


def set_layer_index(module: torch.nn.Module, layer_index: int) -> torch.nn.Module:
    """Record ``layer_index`` (the position in the LayerSpec list) in every parameter's meta."""
    attach_parameter_metas(module)
    for _, param in module.named_parameters():
        replace(get_parameter_meta(param), layer_index=layer_index).attach(param)
    return module


def named_parameters_with_meta(module: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter, ParameterMeta]]:
    """Yield ``(name, parameter, meta)`` for every parameter of ``module`` (shared ones once).

    Raises:
        ValueError: when a parameter carries no meta (build layers through
            :meth:`LayerSpec.initialize` or call :func:`attach_parameter_metas`).
    """
    for name, param in module.named_parameters():
        yield name, param, get_parameter_meta(param)


class LayerSpec:
    """The recipe of one layer: ``module_class(*args, **kwargs)``, built later.

    Args:
        module_class: a :class:`BaseLayer` subclass (any ``torch.nn.Module`` works).
        *args, **kwargs: its constructor arguments (e.g. ``topology=...``).

    Example::

        spec = LayerSpec(module_class=Block, topology=topology, in_features=784, out_features=64)
        layer = spec.initialize()
    """

    def __init__(self, module_class: type[torch.nn.Module], *args: object, **kwargs: object) -> None:
        if not (isinstance(module_class, type) and issubclass(module_class, torch.nn.Module)):
            raise TypeError(
                f"LayerSpec: module_class must be a torch.nn.Module subclass (usually a BaseLayer), "
                f"got {module_class!r}"
            )
        self.module_class = module_class
        self.args = args
        self.kwargs = kwargs

    def initialize(self, **extra_kwargs: object) -> torch.nn.Module:
        """Build the module (``extra_kwargs`` override the spec's) with metas attached."""
        module = self.module_class(*self.args, **{**self.kwargs, **extra_kwargs})
        return attach_parameter_metas(module)

    def __repr__(self) -> str:
        kw = ", ".join(f"{k}={type(v).__name__ if k == 'topology' else repr(v)}" for k, v in self.kwargs.items())
        parts = [self.module_class.__name__, *map(repr, self.args)] + ([kw] if kw else [])
        return f"{type(self).__name__}({', '.join(parts)})"


def _get_attr_path(module: torch.nn.Module, path: str) -> object:
    obj: object = module
    for part in path.split("."):
        if not hasattr(obj, part):
            raise ValueError(
                f"TiedLayerSpec: tied weight attribute {path!r} not found on {type(module).__name__}; "
                f"its parameters are {[n for n, _ in module.named_parameters()]}"
            )
        obj = getattr(obj, part)
    return obj


class TiedLayerSpec(LayerSpec):
    """A :class:`LayerSpec` whose parameters at ``tied_weight_attributes`` are shared with
    every other spec of the same ``key`` (e.g. input embedding and LM head).

    Args:
        key: name of the tied group; recorded as ``ParameterMeta.tied_key``.
        tied_weight_attributes: attribute paths inside the module, e.g. ``["embedding.weight"]``.
        module_class, *args, **kwargs: as for :class:`LayerSpec`.

    The pipeline keeps tied copies equal (same initialisation, gradients summed across
    the stages holding them); the layers themselves only carry the key.
    """

    def __init__(
        self,
        key: str,
        tied_weight_attributes: list[str] | tuple[str, ...] | str,
        module_class: type[torch.nn.Module],
        *args: object,
        **kwargs: object,
    ) -> None:
        super().__init__(module_class, *args, **kwargs)
        if not key:
            raise ValueError(f"TiedLayerSpec: key must be a non-empty string, got {key!r}")
        if isinstance(tied_weight_attributes, str):
            tied_weight_attributes = [tied_weight_attributes]
        if len(tied_weight_attributes) == 0:
            raise ValueError(f"TiedLayerSpec {key!r}: tied_weight_attributes is empty; name at least one parameter")
        self.key = key
        self.tied_weight_attributes = list(tied_weight_attributes)

    def initialize(self, **extra_kwargs: object) -> torch.nn.Module:
        """Build the module and mark its tied parameters with ``tied_key=key``."""
        module = super().initialize(**extra_kwargs)
        for path in self.tied_weight_attributes:
            param = _get_attr_path(module, path)
            if not isinstance(param, torch.nn.Parameter):
                raise ValueError(
                    f"TiedLayerSpec {self.key!r}: {path!r} is a {type(param).__name__}, not a parameter; "
                    f"choose one of {[n for n, _ in module.named_parameters()]}"
                )
            replace(get_parameter_meta(param), tied_key=self.key).attach(param)
        return module
