"""Pipeline stages of an unmodified model, run by scaling.pipeline's executor and schedules.

:class:`PipelineStage` is a ``scaling.pipeline.PipelineStage`` (the executor's Protocol).

A stage keeps the model's own ``forward`` (so masks, rotary embeddings and the loss stay
the model's) and changes only which modules exist on it:

- the blocks ``ModuleList`` keeps only this stage's blocks (under their original indices,
  so parameter paths are layout-independent);
- parameter-owning modules registered before the blocks live on the first stage, those
  after them on the last stage; elsewhere they are replaced by :class:`_Absent` (an
  embedding returns zeros of its output shape, anything else its input), unless a
  parameter of theirs is needed here (a tied LM head keeps the input embedding);
- a stage other than the first swaps the received activation in as its first block's
  input; a stage other than the last stops the forward after its last block.

Modules that own only buffers (e.g. rotary embeddings) are kept everywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, overload

import torch

from scaling.collectives import PyTree, broadcast, broadcast_pytree
from scaling.pipeline import (
    StageExecutor,
    StageTransports,
    TiedGroups,
    forward_only_schedule,
    gpipe_schedule,
    one_f_one_b_schedule,
)
from scaling.topology import Topology
from scaling.trainer.auto._context import sliced
from scaling.trainer.auto._plan import Plan

if TYPE_CHECKING:
    from scaling.config import Metrics

SCHEDULE_FNS = {"1f1b": one_f_one_b_schedule, "gpipe": gpipe_schedule}


class _StageBlocks(torch.nn.ModuleList):
    """This stage's blocks under their original indices; iterating or indexing sees only them."""

    def __init__(self, blocks: Mapping[str, torch.nn.Module]) -> None:
        torch.nn.Module.__init__(self)
        for index, block in blocks.items():
            self.add_module(index, block)

    @overload
    def __getitem__(self, idx: slice) -> torch.nn.ModuleList: ...
    @overload
    def __getitem__(self, idx: int) -> torch.nn.Module: ...
    def __getitem__(self, idx: int | slice) -> torch.nn.Module:
        values = list(self._modules.values())
        return torch.nn.ModuleList(values[idx]) if isinstance(idx, slice) else values[idx]


class _Absent(torch.nn.Module):
    """Stands in for a module that runs before the blocks but belongs to the first stage."""

    def __init__(self, original: torch.nn.Module) -> None:
        super().__init__()
        self.embedding_dim = original.embedding_dim if isinstance(original, torch.nn.Embedding) else None
        weight = getattr(original, "weight", None)
        self.dtype = weight.dtype if isinstance(weight, torch.Tensor) else torch.float32
        self.kind = type(original).__name__

    def forward(self, x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        if self.embedding_dim is None:
            return x
        # The first block's input is replaced by the received activation: the value is unused.
        return torch.zeros((), dtype=self.dtype, device=x.device).expand(*x.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.kind} on another pipeline stage"


class _StageDone(Exception):  # noqa: N818 (control flow, not an error)
    def __init__(self, output: object) -> None:
        super().__init__()
        self.output = output


def _direct_owners(model: torch.nn.Module, blocks_path: str) -> tuple[list[str], list[str]]:
    """Paths of the parameter-owning modules outside the blocks: (before them, after them)."""
    before: list[str] = []
    after: list[str] = []
    seen_blocks = False
    for path, module in model.named_modules():
        if path == blocks_path:
            seen_blocks = True
        if path == blocks_path or path.startswith(blocks_path + "."):
            continue
        if any(True for _ in module.parameters(recurse=False)):
            (after if seen_blocks else before).append(path)
    return before, after


def _block_list(model: torch.nn.Module, plan: Plan) -> torch.nn.ModuleList | torch.nn.Sequential:
    """The indexable container of the model's repeated blocks that the plan splits."""
    blocks = model.get_submodule(plan.blocks_path)
    if not isinstance(blocks, torch.nn.ModuleList | torch.nn.Sequential):
        raise TypeError(
            f"plan.blocks_path={plan.blocks_path!r} is a {type(blocks).__name__}; a pipeline split needs a "
            "ModuleList or Sequential of blocks there"
        )
    return blocks


def stage_ranges(model: torch.nn.Module, plan: Plan) -> list[range]:
    """Block indices of each stage from the plan's split points."""
    num_blocks = len(_block_list(model, plan))
    starts = [0] + [int(p.rpartition(".")[2]) for p in plan.split_points] + [num_blocks]
    return [range(a, b) for a, b in zip(starts, starts[1:])]


def _needed(model: torch.nn.Module, plan: Plan, stage: int) -> set[int]:
    """ids of the parameters stage ``stage`` computes with."""
    before, after = _direct_owners(model, plan.blocks_path)
    blocks = _block_list(model, plan)
    owners = [blocks[i] for i in stage_ranges(model, plan)[stage]]
    if stage == 0:
        owners += [model.get_submodule(p) for p in before]
    if stage == plan.pipe_parallel_size - 1:
        owners += [model.get_submodule(p) for p in after]
    return {id(p) for m in owners for p in m.parameters()}


class PipelineStage:
    """This rank's stage of ``model``: restructured in place, driven by :meth:`run`.

    Call :meth:`__init__` on the deferred (meta) model before materialising it, so the
    modules of other stages are never allocated.

    Args:
        model: the unmodified model (meta device or materialised).
        plan: a plan with ``pipe_parallel_size > 1`` and ``split_points``.
        topology: the initialised topology.
    """

    def __init__(self, model: torch.nn.Module, plan: Plan, topology: Topology) -> None:
        self.model, self.plan, self.topology = model, plan, topology
        self.num_stages, self.stage, self.num_virtual_stages = plan.pipe_parallel_size, topology.axis("pp").rank, 1
        self.schedule_name = plan.pipeline_schedule
        self.transports = StageTransports(topology, 1, plan.static_shapes)
        #: Back-propagates the last stage's loss; parallelize sets the optimizer's (loss scaling).
        self.backward_fn: Callable[[torch.Tensor], None] | None = None
        needed = [_needed(model, plan, s) for s in range(self.num_stages)]
        self.tied = TiedGroups(topology, self._tied_stages(needed))
        mine = needed[self.stage]
        before, after = _direct_owners(model, plan.blocks_path)
        for path in before + after:
            module = model.get_submodule(path)
            if not any(id(p) in mine for p in module.parameters(recurse=False)):
                parent, _, name = path.rpartition(".")
                setattr(model.get_submodule(parent), name, _Absent(module))
        full = _block_list(model, plan)
        local = stage_ranges(model, plan)[self.stage]
        self.chunks = [local]
        self.blocks = _StageBlocks({str(i): full[i] for i in local})
        parent, _, name = plan.blocks_path.rpartition(".")
        setattr(model.get_submodule(parent), name, self.blocks)
        self._incoming: torch.Tensor | None = None
        first, last = self.blocks[0], self.blocks[-1]
        if self.stage > 0:
            first.register_forward_pre_hook(self._swap_input, with_kwargs=True)
        if self.stage < self.num_stages - 1:
            last.register_forward_hook(self._stop)

    # ------------------------------------------------------------ tied weights
    def _tied_stages(self, needed: list[set[int]]) -> dict[str, list[int]]:
        """Per parameter path (model order, the same on every rank; paths, since materialising
        replaces the meta parameters): the stages that use it."""
        return {
            path: [s for s in range(self.num_stages) if id(param) in needed[s]]
            for path, param in self.model.named_parameters()
        }

    def reduce_tied_gradients(self) -> None:
        """Sum the gradients of parameters held on several stages (e.g. a tied LM head)."""
        self.tied.reduce_gradients(lambda path: [self.model.get_parameter(path)])

    # ------------------------------------------------------------ forward
    def _swap_input(
        self, module: torch.nn.Module, args: tuple[object, ...], kwargs: dict[str, object]
    ) -> tuple[tuple[object, ...], dict[str, object]]:
        if args:
            return (self._incoming, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": self._incoming}

    def _stop(self, module: torch.nn.Module, args: tuple[object, ...], output: object) -> None:
        raise _StageDone(output)

    def chunk_parameters(self, chunk: int) -> list[torch.nn.Parameter]:
        """This stage's trainable parameters (one chunk per stage here)."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def forward_chunk(self, chunk: int, x: PyTree) -> PyTree:
        """The executor's hook: micro-batch (first stage) or received activation in, activation or output out."""
        if self.stage == 0:
            batch = x
        else:
            batch, self._incoming = x["batch"], x["hidden_states"]
        try:
            if self.topology.axis("cp").size > 1:  # this rank's slice of the micro-batch
                with sliced(batch, self.topology, self.plan.context_parallel_method) as kwargs:
                    return self.model(**kwargs)
            return self.model(**batch)
        except _StageDone as done:
            hidden = done.output[0] if isinstance(done.output, tuple) else done.output
            return {"hidden_states": hidden, "batch": batch}
        finally:
            self._incoming = None

    # ------------------------------------------------------------ one schedule
    def run(self, batch: object, forward_only: bool = False) -> torch.Tensor:
        """Forward and backward of ``batch`` (this DP rank's) over the schedule; the mean loss.

        Gradients accumulate into ``.grad``; tied-weight and DP reductions and the update
        are the optimizer's (``step()``), as in the plain loop. ``forward_only``: evaluation,
        the forward-only schedule without gradients (nothing accumulates).
        """
        if not isinstance(batch, Mapping):
            raise TypeError(
                f"a pipelined model takes a mapping batch (model(**batch) keywords), got {type(batch).__name__}"
            )
        n = self.plan.num_micro_batches
        sizes = {k: v.shape[0] for k, v in batch.items() if isinstance(v, torch.Tensor)}
        if any(s % n for s in sizes.values()):
            raise ValueError(
                f"pipeline_parallel.num_micro_batches={n} does not divide the batch sizes {sizes}; "
                "make the per-DP-rank batch a multiple of it"
            )
        micro = _split(batch, n)
        if forward_only:
            with torch.no_grad():
                transport = self.transports.get(False)
                executor = StageExecutor(self, micro, _loss_of, transport)
                outputs = executor.run(forward_only_schedule(self.num_stages, n, self.stage))
        else:
            transport = self.transports.get(torch.is_grad_enabled())
            executor = StageExecutor(self, micro, _loss_of, transport, loss_backward=self.backward_fn)
            # The update and the tied-weight sum belong to optimizer.step(), so several calls
            # before one step accumulate gradients exactly as on one device.
            outputs = executor.run(SCHEDULE_FNS[self.schedule_name](self.num_stages, n, self.stage))
        return self._broadcast_loss(outputs.losses, n)

    def logits(self, batch: Mapping[str, object]) -> torch.Tensor:
        """The logits of ``batch`` (this CP rank's slice of each sequence under context parallelism)
        on every stage: the forward-only schedule, the last stage's ``output.logits`` broadcast.

        The batch goes as the plan's micro-batches where they divide it, else as one.
        """
        n = self.plan.num_micro_batches
        sizes = {v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor)}
        n = n if all(size % n == 0 for size in sizes) else 1
        micro = _split(batch, n)
        captured: list[torch.Tensor] = []

        def capture(output: PyTree, _targets: PyTree) -> tuple[torch.Tensor, Metrics]:
            captured.append(output.logits)  # the forward-only schedule runs the micro-batches in order
            return torch.zeros((), device=self.topology.device), {}

        with torch.no_grad():
            executor = StageExecutor(self, micro, capture, self.transports.get(False))
            executor.run(forward_only_schedule(self.num_stages, n, self.stage))
        last = self.stage == self.num_stages - 1
        pp = self.topology.axis("pp")
        logits = broadcast_pytree(torch.cat(captured) if last else None, pp.ranks[-1], pp.group)
        assert logits is not None  # the last stage's, on every stage
        return logits

    def _broadcast_loss(self, losses: Mapping[int, torch.Tensor], n: int) -> torch.Tensor:
        """The mean of the last stage's micro-batch ``losses``, on every stage."""
        loss = torch.zeros((), dtype=torch.float32, device=self.topology.device)
        if self.stage == self.num_stages - 1:
            loss += torch.stack([losses[i].float() for i in range(n)]).mean()
        topo = self.topology
        broadcast(
            loss,
            topo.axis("pp").ranks[self.num_stages - 1],
            topo.axis("pp").group,
        )
        return loss


def _split(batch: Mapping[str, object], n: int) -> list[dict[str, object]]:
    """``n`` micro-batches of ``batch``: its tensors chunked along the batch dimension, the rest shared."""
    return [{k: (v.chunk(n)[i] if isinstance(v, torch.Tensor) else v) for k, v in batch.items()} for i in range(n)]


def _loss_of(output: PyTree, _targets: PyTree) -> tuple[torch.Tensor, Metrics]:
    loss = getattr(output, "loss", output)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise ValueError(
            "the last pipeline stage's model output must be a scalar loss (or have a .loss, e.g. pass labels to a "
            f"transformers model), got {type(output).__name__}"
        )
    return loss, {}
