"""Loss and metrics of a step: computed on the last stage, returned on every rank.

The last stage broadcasts them over the pipe group, then data-parallel replicas average
them. Once the metric names are known (the first step, cached on the module on every
rank of the pipe group alike) the broadcast is one ``float64`` tensor
``[names changed?, loss, *metrics]``; only when the names change does a pytree broadcast
(three collectives) follow.

The other stages post their side of that broadcast early (:func:`post_result_receive`,
called by the executor just before the stage first waits for a message, when it is idle
anyway), so the values have arrived by the time they finish their last backward and the
step ends without a round trip. A step that raises still does its part of the broadcast
on every rank (:func:`abandon_result_broadcast`), so the next step pairs up with its
own. The broadcast runs on ``topology.pipe_parallel_result_group``, a second group over
the pipe ranks, so a collective posted this early never interleaves with the pipe
group's own traffic (activations, gradients, tied-weight sums), whose order must match
on every rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

from scaling.collectives import PendingCollective, all_reduce, broadcast, broadcast_async, broadcast_pytree

# values[0] of the result broadcast: 1.0 names changed (a pytree broadcast follows),
# _ABORTED the step raised on the last stage (no reader: see abandon_result_broadcast).
_ABORTED = 2.0

if TYPE_CHECKING:
    from scaling.pipeline._parallel_module import ParallelModule


class _Executor(Protocol):
    module: ParallelModule
    p: int
    losses: dict[int, torch.Tensor]
    metrics: dict[int, dict[str, Any]]


def default_aggregation(topology: Any, metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean of each metric over the micro-batches."""
    if not metrics:
        return {}
    return {k: sum(float(m[k]) for m in metrics) / len(metrics) for k in metrics[0]}


def post_result_receive(module: ParallelModule) -> tuple[PendingCollective, torch.Tensor] | None:
    """On a stage other than the last, post the receive of this step's results (see the module doc).

    Returns None on the last stage, without pipeline parallelism, or while the metric
    names are unknown (the first step, or a module-like that gathers its results itself,
    such as the high-level API's pipeline stage), which take the blocking path at the end.
    """
    return None if module.topology.is_last_pipe_stage else _start_result_broadcast(module)


def abandon_result_broadcast(module: ParallelModule) -> None:
    """The last stage, after an exception in the step: send the result broadcast flagged as aborted.

    The other stages posted (or post, on their own exception) their receive of this
    step's results; sending one keeps every rank at one broadcast per step, so the next
    step's results reach the next step. Nobody waits for it. Nothing is sent while the
    metric names are unknown, since then nobody posted.
    """
    _start_result_broadcast(module, flag=_ABORTED)


def _start_result_broadcast(module: ParallelModule, flag: float = 0.0) -> tuple[PendingCollective, torch.Tensor] | None:
    """The one-tensor result broadcast of this step, started with ``values[0] = flag``.

    None (nothing started) without pipeline parallelism or while the metric names are unknown.
    """
    topo, names = module.topology, getattr(module, "_metric_names", None)
    if module.num_stages == 1 or names is None:
        return None
    values = torch.zeros(2 + len(names), dtype=torch.float64, device=topo.device)
    values[0] = flag
    return broadcast_async(values, _last_stage_rank(module), topo.pipe_parallel_result_group), values


def gather_results(
    ex: _Executor, aggregate: Any, posted: tuple[PendingCollective, torch.Tensor] | None = None
) -> tuple[float, dict[str, float]]:
    """Loss and metrics from the last stage, broadcast over the pipe group, averaged over DP.

    ``posted``: this rank's receive from :func:`post_result_receive`, if any.
    """
    topo = ex.module.topology
    result: Any = None
    if topo.is_last_pipe_stage:
        mb = sorted(ex.losses)
        loss = sum(float(ex.losses[i]) for i in mb) / len(mb)
        metrics = (aggregate or default_aggregation)(topo, [ex.metrics[i] for i in mb])
        result = {"loss": loss, "metrics": {k: float(v) for k, v in metrics.items()}}
    if ex.p > 1:
        result = _broadcast_result(ex.module, result, posted)
    if topo.data_parallel_size > 1:
        values = torch.tensor([result["loss"], *result["metrics"].values()], dtype=torch.float64, device=topo.device)
        all_reduce(values, topo.data_parallel_group)
        values /= topo.data_parallel_size
        result = {"loss": float(values[0]), "metrics": dict(zip(result["metrics"], values[1:].tolist()))}
    return float(result["loss"]), dict(result["metrics"])


def _last_stage_rank(module: ParallelModule) -> int:
    topo = module.topology
    return topo.rank_of(module.num_stages - 1, topo.data_parallel_rank, topo.model_parallel_rank)


def _broadcast_result(
    module: ParallelModule, result: dict[str, Any] | None, posted: tuple[PendingCollective, torch.Tensor] | None
) -> dict[str, Any]:
    group, names = module.topology.pipe_parallel_result_group, module._metric_names
    src = _last_stage_rank(module)
    if posted is not None:
        posted[0].wait()
        values = posted[1].cpu()
    else:
        values = torch.zeros(2 + (0 if names is None else len(names)), dtype=torch.float64)
        if result is not None:  # the last stage
            if names is not None and tuple(result["metrics"]) == names:
                values[1:] = torch.tensor([result["loss"], *result["metrics"].values()], dtype=torch.float64)
            else:
                values[0] = 1.0
        values = broadcast(values.to(module.topology.device), src, group).cpu()
    if values[0] == 1.0:
        result = broadcast_pytree(result, src, group)
        assert result is not None
        module._metric_names = tuple(result["metrics"])
        return result
    assert names is not None
    got = values.tolist()
    return {"loss": got[1], "metrics": dict(zip(names, got[2:]))}
