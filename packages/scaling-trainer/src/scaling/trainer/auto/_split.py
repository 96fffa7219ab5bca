"""Pipeline split points: partition the model's blocks by flops, parameters or count."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import cast

import torch

from scaling.trainer.auto._policy import is_conv1d

SPLIT_METHODS = ("flops", "parameters", "uniform")


def find_blocks(model: torch.nn.Module) -> tuple[str, list[str]]:
    """The longest ``ModuleList`` of ``model`` (the repeated blocks) and its item paths.

    Raises:
        ValueError: the model has no ``ModuleList`` to split.
    """
    lists = [(p, m) for p, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 0]
    if not lists:
        raise ValueError(
            f"pipeline_parallel: {type(model).__name__} has no torch.nn.ModuleList of blocks to split into stages; "
            "use pipeline_parallel.size=1"
        )
    path, blocks = max(lists, key=lambda pm: len(pm[1]))
    return path, [f"{path}.{i}" if path else str(i) for i in range(len(blocks))]


def _cost(module: torch.nn.Module, method: str, seen: set[int]) -> float:
    if method == "uniform":
        return 1.0
    total = 0.0
    for sub in module.modules():
        for p in sub.parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            # flops of a token through a matmul are 2 * weight.numel(); lookups and norms are ~free
            matmul = isinstance(sub, torch.nn.Linear) or is_conv1d(sub)
            if method == "parameters" or (matmul and p.dim() == 2):
                total += p.numel()
    return total


def _edge_costs(model: torch.nn.Module, blocks_path: str, method: str) -> tuple[float, list[float], float]:
    """Cost of what runs before the blocks, of each block, and of what runs after."""
    if method not in SPLIT_METHODS:
        raise ValueError(
            f"constraint pipeline_parallel.split_method={method!r} is invalid; choose one of {SPLIT_METHODS}"
        )
    # The blocks container is a ModuleList / Sequential: iterable, which nn.Module's type is not.
    blocks = cast(Iterable[torch.nn.Module], model.get_submodule(blocks_path))
    seen: set[int] = set()
    block_costs = [_cost(b, method, seen) for b in blocks]
    pre = post = 0.0
    if method != "uniform":
        after = False
        for path, child in model.named_modules():
            if path == blocks_path:
                after = True
            if (
                path == blocks_path
                or path.startswith(blocks_path + ".")
                or (blocks_path.startswith(path) and path != blocks_path)
            ):
                continue
            cost = sum(p.numel() for p in _direct(child, method, seen))
            if after:
                post += cost
            else:
                pre += cost
    return pre, block_costs, post


def _direct(module: torch.nn.Module, method: str, seen: set[int]) -> list[torch.Tensor]:
    matmul = isinstance(module, torch.nn.Linear) or is_conv1d(module)
    out: list[torch.Tensor] = []
    for p in module.parameters(recurse=False):
        if id(p) not in seen and (method == "parameters" or (matmul and p.dim() == 2)):
            seen.add(id(p))
            out.append(p)
    return out


def _partition(costs: list[float], pre: float, post: float, stages: int, allowed: set[int]) -> list[int]:
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][j]: smallest max-stage cost putting blocks[:j] on k stages; back[k][j]: start of stage k
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    back = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for j in range(k, n + 1):
            if j < n and j not in allowed:
                continue
            for i in range(k - 1, j):
                if best[k - 1][i] == inf:
                    continue
                stage = prefix[j] - prefix[i] + (pre if k == 1 else 0.0) + (post if j == n else 0.0)
                value = max(best[k - 1][i], stage)
                if value < best[k][j]:
                    best[k][j], back[k][j] = value, i
    if best[stages][n] == inf:
        return []
    cuts, j = [], n
    for k in range(stages, 1, -1):
        j = back[k][j]
        cuts.append(j)
    return sorted(cuts)


def split_blocks(
    model: torch.nn.Module,
    blocks_path: str,
    blocks: list[str],
    stages: int,
    method: str,
    explicit: Sequence[str] | None = None,
    forbidden: Sequence[str] = (),
) -> list[str]:
    """Module paths of the first block of stages ``1..stages-1``.

    Raises:
        ValueError: more stages than blocks, an unknown or forbidden split point, or
            no split satisfying the constraints.
    """
    pre, costs, post = _edge_costs(model, blocks_path, method)
    if stages > len(blocks):
        raise ValueError(
            f"pipeline_parallel.size={stages} is more stages than the {len(blocks)} blocks of {blocks_path!r}; "
            f"choose at most {len(blocks)}"
        )
    bad = sorted(set(forbidden) - set(blocks))
    if bad:
        raise ValueError(f"pipeline_parallel.forbidden_split_points {bad} are not blocks of {blocks_path!r}: {blocks}")
    if explicit is not None:
        explicit = list(explicit)
        if len(explicit) != stages - 1:
            raise ValueError(
                f"pipeline_parallel.split_points has {len(explicit)} entries; {stages} stages need {stages - 1}"
            )
        for point in explicit:
            if point not in blocks[1:]:
                raise ValueError(f"pipeline_parallel.split_points: {point!r} is not one of the blocks {blocks[1:]}")
            if point in forbidden:
                raise ValueError(
                    f"pipeline_parallel.split_points: {point!r} is in pipeline_parallel.forbidden_split_points"
                )
        if [blocks.index(p) for p in explicit] != sorted(blocks.index(p) for p in explicit):
            raise ValueError(f"pipeline_parallel.split_points {explicit} must be in model order")
        return explicit
    allowed = {i for i in range(1, len(blocks)) if blocks[i] not in forbidden}
    cuts = _partition(costs, pre, post, stages, allowed)
    if not cuts and stages > 1:
        raise ValueError(
            f"pipeline_parallel: no split of {blocks_path!r} into {stages} stages avoids the forbidden split points "
            f"{sorted(forbidden)}; allow more split points or use fewer stages"
        )
    return [blocks[i] for i in cuts]
