"""Every Protocol in the packages, and what implements it (#48, ARCHITECTURE.md "The step").

A Protocol is declared only where there are two implementations or an outside library: a
Protocol describing one class is a second name for it, and a reader (or an IDE) following
a parameter of that type lands on a stub instead of the class. This test finds every
``class X(... Protocol ...)`` under ``packages/*/src`` and ``apps/*/src`` and holds it to the
table below: for ours, at least two classes of the repository that have every member the
Protocol declares; for an outside library's, the library named. A new Protocol fails here
until it is listed with its implementations.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
import typing
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# "module:Protocol" -> the classes implementing it ("module:Class"), or the outside library.
PROTOCOLS: dict[str, list[str] | str] = {
    "scaling.data._build:_Encoding": "tokenizers (Encoding)",
    "scaling.data._build:_Tokenizer": "tokenizers (Tokenizer; an optional dependency)",
    "scaling.data._build:_Progress": "tqdm",
    "scaling.trainer._profiler:ProgressBar": "tqdm",
    "scaling.nn._float8_layers:TensorParallelLinear": [
        "scaling.nn:ColumnParallelLinear",
        "scaling.nn:RowParallelLinear",
    ],
    "scaling.optim._zero3:LayeredModule": [
        "scaling.pipeline:ParallelModule",
        "scaling.trainer.auto._parallelize:ParallelModel",
    ],
    "scaling.pipeline._executor:PipelineStage": [
        "scaling.pipeline:ParallelModule",
        "scaling.trainer.auto._pipeline:PipelineStage",
    ],
    "scaling.trainer._placement:MovableBatch": ["torch:Tensor", "scaling.data:BaseDatasetBatch"],
    "scaling.trainer.loggers._sinks:Sink": [
        "scaling.trainer.loggers._sinks:ConsoleSink",
        "scaling.trainer.loggers._sinks:JsonlSink",
        "scaling.trainer.loggers._sinks:TensorBoardSink",
        "scaling.trainer.loggers._sinks:WandbSink",
    ],
}

# Known, with one implementation, and why each stays for now (a debt, not a design). Both
# break an import circle that a TYPE_CHECKING import would still make
# (tests/test_import_graph.py counts those): the optimizer's state functions read the
# optimizer that calls them, the high-level API's optimizer the model that builds it.
ONE_IMPLEMENTATION = {
    "scaling.trainer.auto._optimizer:PlannedModel": "ParallelModel; goes when the high-level API builds the "
    "same parts as the first way in (#49)",
}


def _declared() -> set[str]:
    found = set()
    for source in [*ROOT.glob("packages/*/src/scaling/**/*.py"), *ROOT.glob("apps/*/src/scaling/**/*.py")]:
        parts = source.with_suffix("").parts
        module = ".".join(parts[parts.index("src") + 1 :]).removesuffix(".__init__")
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                (isinstance(b, ast.Name) and b.id == "Protocol")
                or (isinstance(b, ast.Attribute) and b.attr == "Protocol")
                for b in node.bases
            ):
                found.add(f"{module}:{node.name}")
    return found


def _members(cls: type) -> set[str]:
    """What ``cls`` has: class attributes, annotations, and the ``self.<name> = ...`` of its methods."""
    names = set(dir(cls))
    for klass in cls.__mro__:
        names |= set(getattr(klass, "__annotations__", {}))
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):  # built-in (torch.Tensor's C part)
            continue
        for node in ast.walk(tree):
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AnnAssign)
                else []
            )
            for target in [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]:
                if (
                    isinstance(target, ast.Attribute)
                    and isinstance(target.value, ast.Name)
                    and target.value.id == "self"
                ):
                    names.add(target.attr)
    return names


def _load(path: str) -> type:
    module, _, name = path.partition(":")
    return typing.cast(type, getattr(importlib.import_module(module), name))


def test_every_protocol_is_listed():
    declared = _declared()
    listed = set(PROTOCOLS) | set(ONE_IMPLEMENTATION)
    assert declared == listed, (
        f"not listed (add it with its implementations, or use the class): {sorted(declared - listed)}; "
        f"listed but gone: {sorted(listed - declared)}"
    )


@pytest.mark.parametrize("protocol", sorted(p for p, v in PROTOCOLS.items() if isinstance(v, list)))
def test_ours_have_two_implementations_with_every_member(protocol):
    implementers = PROTOCOLS[protocol]
    assert isinstance(implementers, list) and len(implementers) >= 2, implementers
    members = typing._get_protocol_attrs(_load(protocol))  # type: ignore[attr-defined]
    for path in implementers:
        missing = set(members) - _members(_load(path))
        assert not missing, f"{path} lacks {sorted(missing)} of {protocol}"
