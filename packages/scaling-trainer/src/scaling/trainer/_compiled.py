"""What the step log says about compilation (a module whose ``compile_config.enabled`` is set).

Each step adds ``compile/graphs`` (graphs Dynamo compiled so far, the largest count of any
rank), ``compile/recompiles`` (recompilations in this step, largest of any rank) and
``compile/graph_breaks`` (distinct reasons a graph broke so far: the call at a break runs
eagerly, by design for the collectives of TP, CP and EP). Every recompilation is logged as
a warning on the rank where it happened, with Dynamo's reason (the guard that failed: a
shape, dtype or module-state change), and every new graph-break reason once, at info
level: nothing falls back to eager silently. The first step's compilations are the
warm-up; a recompile later is what a user wants to see.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from scaling.collectives import all_reduce
from scaling.nn import CompileConfig, CompileMonitor

logger = logging.getLogger("scaling.trainer")


class CompileLog:
    """Compilation metrics and recompile warnings for ``module`` (nothing when it is not compiled)."""

    def __init__(self, module: object, rank: int, device: torch.device) -> None:
        config = getattr(module, "compile_config", None)
        enabled = isinstance(config, CompileConfig) and config.enabled
        self.monitor = CompileMonitor() if enabled else None
        self.rank, self.device = rank, device

    def step_metrics(self, step: int) -> dict[str, float]:
        """This step's ``compile/*`` metrics (one small all-reduce over every rank), or ``{}``."""
        if self.monitor is None:
            return {}
        _, reasons = self.monitor.poll()
        for reason in reasons:
            logger.warning(
                "rank %d, step %d: compiled code recompiled (a layer or the loss): %s", self.rank, step, reason
            )
        for reason in self.monitor.new_graph_breaks():
            logger.info(
                "rank %d, step %d: compiled code runs a call eagerly (graph break): %s", self.rank, step, reason
            )
        counts = torch.tensor(
            [self.monitor.graphs, len(reasons), self.monitor.graph_breaks], dtype=torch.float64, device=self.device
        )
        if dist.is_initialized() and dist.get_world_size() > 1:
            all_reduce(counts, dist.group.WORLD, op=dist.ReduceOp.MAX)
        graphs, recompiles, breaks = counts.tolist()
        return {"compile/graphs": graphs, "compile/recompiles": recompiles, "compile/graph_breaks": breaks}
