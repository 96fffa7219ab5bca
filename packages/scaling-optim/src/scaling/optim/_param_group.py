"""Parameter groups and the regex helper that builds them."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from scaling.collectives import all_reduce, group_device
from scaling.nn import ParameterMeta
from scaling.optim._config import OptimizerParamGroupConfig
from scaling.optim._lr_scheduler import LearningRateScheduler

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

NamedParameterWithMeta = tuple[str, torch.nn.Parameter, ParameterMeta]


class OptimizerParamGroup:
    """Parameters that share a weight decay and an LR schedule.

    Args:
        named_parameters_with_meta: ``(name, parameter, meta)`` triples, as yielded by
            ``ParallelModule.named_parameters_with_meta()``. Parameters with
            ``requires_grad=False`` are frozen: kept out of the update and the state.
        config: weight decay, LR schedule and the group name.

    Raises:
        TypeError: an entry is not a ``(str, Parameter, ParameterMeta)`` triple.
        ValueError: a meta's ``logical_shape`` does not fit the parameter's local shape,
            or a meta key appears twice.
    """

    def __init__(
        self, named_parameters_with_meta: Iterable[NamedParameterWithMeta], config: OptimizerParamGroupConfig
    ) -> None:
        self.config = config
        self.named_parameters_with_meta: list[NamedParameterWithMeta] = []
        seen: dict[str, str] = {}
        for entry in named_parameters_with_meta:
            if not (isinstance(entry, tuple) and len(entry) == 3):
                raise TypeError(f"group {config.name!r}: expected (name, parameter, meta) triples, got {entry!r}")
            name, param, meta = entry
            if not isinstance(param, torch.Tensor) or not isinstance(meta, ParameterMeta):
                raise TypeError(
                    f"group {config.name!r}: entry {name!r} needs a torch.nn.Parameter and a ParameterMeta, got "
                    f"{type(param).__name__} and {type(meta).__name__}"
                )
            _check_shape(name, param, meta)
            if meta.key in seen:
                raise ValueError(
                    f"group {config.name!r}: meta key {meta.key!r} is used by both {seen[meta.key]!r} and {name!r}; "
                    "every parameter needs its own ParameterMeta key"
                )
            seen[meta.key] = name
            self.named_parameters_with_meta.append((name, param, meta))
        self.scheduler = LearningRateScheduler(config.learning_rate_scheduler)

    @property
    def name(self) -> str:
        return self.config.name

    def trainable(self) -> list[NamedParameterWithMeta]:
        """The triples whose parameter requires grad."""
        return [t for t in self.named_parameters_with_meta if t[1].requires_grad]

    def __repr__(self) -> str:
        n = len(self.named_parameters_with_meta)
        return f"OptimizerParamGroup({self.name!r}, {n} parameters, weight_decay={self.config.weight_decay})"


def _check_shape(name: str, param: torch.Tensor, meta: ParameterMeta) -> None:
    expected = list(meta.logical_shape)
    if meta.is_model_parallel:
        assert meta.parallel_dim is not None
        expected[meta.parallel_dim] = meta.local_size(0)[0]  # a padded dimension (a vocabulary) rounds up
    if list(param.shape) != expected:
        raise ValueError(
            f"parameter {name!r}: local shape {list(param.shape)} does not match its meta (logical_shape="
            f"{list(meta.logical_shape)}, parallel_dim={meta.parallel_dim}, model_parallel_size="
            f"{meta.model_parallel_size}); expected {expected}"
        )


def build_parameter_groups(
    named_parameters_with_meta: Iterable[NamedParameterWithMeta],
    group_configs: Sequence[OptimizerParamGroupConfig],
    frozen: Sequence[str] = (),
    process_group: ProcessGroup | None = None,
) -> list[OptimizerParamGroup]:
    """Split parameters into groups by the regexes of each group config.

    A parameter belongs to a group when one of its ``parameters_include`` patterns and
    none of its ``parameters_exclude`` patterns ``re.search`` its name. Parameters
    matching a ``frozen`` pattern get ``requires_grad_(False)`` and join no group.

    Args:
        named_parameters_with_meta: ``(name, parameter, meta)`` triples.
        group_configs: one config per group, names unique.
        frozen: regexes of parameters frozen on purpose.
        process_group: with pipeline parallelism, the group over which "a pattern matches
            nothing" is decided (e.g. ``topology.axis("replica").group``): a pattern
            must match on some rank, not on every rank. None = this rank only.

    Raises:
        ValueError: duplicate group names, an invalid regex, a pattern that matches
            nothing, a parameter in two groups (overlapping patterns), a parameter both
            frozen and grouped, or a parameter in no group and not frozen.
    """
    names = [c.name for c in group_configs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"group names must be unique; {dupes} appear more than once")
    triples = list(named_parameters_with_meta)
    patterns: list[tuple[str, str, re.Pattern[str]]] = []  # (owner, pattern text, compiled)
    for c in group_configs:
        for text in (*c.parameters_include, *c.parameters_exclude):
            patterns.append((c.name, text, _compile(c.name, text)))
    for text in frozen:
        patterns.append(("frozen", text, _compile("frozen", text)))

    hits = torch.tensor([sum(bool(p.search(n)) for n, _, _ in triples) for _, _, p in patterns], dtype=torch.long)
    if process_group is not None and hits.numel():
        # Summed on the group's device (NCCL takes no CPU tensor).
        hits = all_reduce(hits.to(group_device(process_group) or hits.device), process_group).cpu()
    unmatched = [f"{owner}: {text!r}" for (owner, text, _), h in zip(patterns, hits.tolist()) if h == 0]
    if unmatched:
        raise ValueError(f"parameter patterns match no parameter: {unmatched}; fix or remove them")

    members: dict[str, list[NamedParameterWithMeta]] = {c.name: [] for c in group_configs}
    problems: list[str] = []
    for triple in triples:
        name = triple[0]
        owners = [c.name for c in group_configs if _selects(c, name)]
        is_frozen = any(re.search(t, name) for t in frozen)
        if is_frozen and owners:
            problems.append(f"{name!r} is frozen and also in group(s) {owners}")
        elif len(owners) > 1:
            problems.append(f"{name!r} matches groups {owners} (overlapping patterns)")
        elif not owners and not is_frozen:
            problems.append(f"{name!r} is in no group and not frozen")
        elif is_frozen:
            triple[1].requires_grad_(False)
        else:
            members[owners[0]].append(triple)
    if problems:
        raise ValueError(
            "every parameter must be in exactly one group or frozen on purpose: "
            + "; ".join(problems)
            + ". Adjust parameters_include/parameters_exclude or the frozen patterns"
        )
    return [OptimizerParamGroup(members[c.name], c) for c in group_configs]


def _compile(owner: str, text: str) -> re.Pattern[str]:
    try:
        return re.compile(text)
    except re.error as err:
        raise ValueError(f"{owner}: invalid parameter pattern {text!r}: {err}") from err


def _selects(config: OptimizerParamGroupConfig, name: str) -> bool:
    included = any(re.search(t, name) for t in config.parameters_include)
    return included and not any(re.search(t, name) for t in config.parameters_exclude)
