"""Loss and metrics of a step: computed on the loss's pipeline stage, returned on every rank.

The stage that computes the loss (the last one; stage 0 when ZB-V places the chunks in a V)
aggregates its micro-batches' metrics and broadcasts loss and metrics over
the pipe group, then data-parallel replicas average them. Once the metric names are known
(the first step; kept per module on every rank of the pipe group alike) the broadcast is
one ``float64`` tensor ``[names changed?, loss, *metrics]``; only when the names change
does a pytree broadcast (three collectives) follow.

The other stages post their side of that broadcast early (:meth:`StepResults.post_receive`,
which the step hands the schedule as its ``before_first_wait`` hook: the stage is idle
then anyway), so the values have arrived by the time they finish their last backward and
the step ends without a round trip. A step that raises still does its part of the
broadcast on every rank (:meth:`StepResults.abandon`), so the next step pairs up with its
own. The broadcast runs on ``topology.axis("pp_result").group``, a second group over
the pipe ranks, so a collective posted this early never interleaves with the pipe group's
own traffic (activations, gradients, tied-weight sums), whose order must match on every
rank.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from scaling.collectives import PendingCollective, all_reduce, broadcast, broadcast_async, broadcast_pytree
from scaling.config import Metrics
from scaling.pipeline import ParallelModule, StageOutputs
from scaling.topology import Topology

MetricsAggregation = Callable[[Topology, list[Metrics]], Metrics]

# values[0] of the result broadcast: 1.0 names changed (a pytree broadcast follows),
# _ABORTED the step raised on the last stage (no reader: see StepResults.abandon).
_ABORTED = 2.0


class _MetricNames:
    """The metric names of a module's last step, the same on every rank of its pipe group."""

    names: tuple[str, ...] | None = None


# Per module (weakly): the names outlive one step so later steps broadcast one tensor.
_NAMES: weakref.WeakKeyDictionary[ParallelModule, _MetricNames] = weakref.WeakKeyDictionary()


def default_aggregation(topology: Topology, metrics: list[Metrics]) -> Metrics:
    """Mean of each metric over the micro-batches."""
    if not metrics:
        return {}
    return {k: sum(float(m[k]) for m in metrics) / len(metrics) for k in metrics[0]}


class StepResults:
    """One step's loss and metrics on every rank of ``module``'s pipe and data-parallel groups.

    Args:
        module: the stage that runs the step (its ``topology`` and ``num_stages``); the
            metric names are kept per module across steps.
        aggregate: ``(topology, [metrics per micro-batch]) -> metrics`` on the last stage;
            default: the mean per key over micro-batches.
    """

    def __init__(self, module: ParallelModule, aggregate: MetricsAggregation | None = None) -> None:
        self.topology: Topology = module.topology
        self.num_stages: int = module.num_stages
        self.aggregate = aggregate or default_aggregation
        self._names = _NAMES.setdefault(module, _MetricNames())
        self._posted: tuple[PendingCollective, torch.Tensor] | None = None
        #: Where the loss is computed: the last stage (stage 0 under ZB-V's V placement).
        self._loss_stage = module.loss_stage
        self._computes_loss = self.topology.axis("pp").rank == self._loss_stage
        self._to_post = not self._computes_loss

    def post_receive(self) -> None:
        """On a stage other than the last, post the receive of this step's results (once).

        Nothing is posted without pipeline parallelism or while the metric names are
        unknown (the first step): those take the blocking path in :meth:`gather`.
        """
        if self._to_post:
            self._to_post = False
            self._posted = self._start(0.0)

    def abandon(self) -> None:
        """After an exception in the step: do this rank's part of the broadcast, flagged aborted.

        The other stages posted (or post, on their own exception) their receive of this
        step's results; sending one keeps every rank at one broadcast per step, so the next
        step's results reach the next step. Nobody waits for it.
        """
        if self._computes_loss:
            self._start(_ABORTED)
        else:
            self.post_receive()

    def _start(self, flag: float) -> tuple[PendingCollective, torch.Tensor] | None:
        names = self._names.names
        if self.num_stages == 1 or names is None:
            return None
        values = torch.zeros(2 + len(names), dtype=torch.float64, device=self.topology.device)
        values[0] = flag
        return broadcast_async(values, self._last_stage_rank(), self.topology.axis("pp_result").group), values

    def gather(self, outputs: StageOutputs) -> tuple[float, dict[str, float]]:
        """Loss and metrics from the last stage, broadcast over the pipe group, averaged over DP."""
        self.post_receive()  # a stage that never waited for a message posts it now
        topo = self.topology
        result: Metrics | None = None
        if self._computes_loss:
            mb = sorted(outputs.losses)
            loss = sum(float(outputs.losses[i]) for i in mb) / len(mb)
            metrics = self.aggregate(topo, [outputs.metrics[i] for i in mb])
            result = {"loss": loss, "metrics": {k: float(v) for k, v in metrics.items()}}
        if self.num_stages > 1:
            result = self._broadcast(result)
        assert result is not None  # the last stage made it; the broadcast brought it to the others
        if topo.axis("dp_cp").size > 1:
            # Over DP × CP: a CP rank's loss is its share of the sequence's loss, scaled so
            # that the mean over the CP ranks is the sequence's loss.
            values = torch.tensor(
                [result["loss"], *result["metrics"].values()], dtype=torch.float64, device=topo.device
            )
            all_reduce(values, topo.axis("dp_cp").group)
            values /= topo.axis("dp_cp").size
            result = {"loss": float(values[0]), "metrics": dict(zip(result["metrics"], values[1:].tolist()))}
        return float(result["loss"]), dict(result["metrics"])

    def _last_stage_rank(self) -> int:
        return self.topology.axis("pp").ranks[self._loss_stage]

    def _broadcast(self, result: Metrics | None) -> Metrics:
        group, names, src = self.topology.axis("pp_result").group, self._names.names, self._last_stage_rank()
        if self._posted is not None:
            self._posted[0].wait()
            values = self._posted[1].cpu()
        else:
            values = torch.zeros(2 + (0 if names is None else len(names)), dtype=torch.float64)
            if result is not None:  # the last stage
                if names is not None and tuple(result["metrics"]) == names:
                    values[1:] = torch.tensor([result["loss"], *result["metrics"].values()], dtype=torch.float64)
                else:
                    values[0] = 1.0
            values = broadcast(values.to(self.topology.device), src, group).cpu()
        if values[0] == 1.0:
            result = broadcast_pytree(result, src, group)
            assert result is not None
            self._names.names = tuple(result["metrics"])
            return result
        assert names is not None
        got = values.tolist()
        return {"loss": got[1], "metrics": dict(zip(names, got[2:]))}
