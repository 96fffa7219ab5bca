"""The executor: run one stage's instruction list with real tensors and real messages.

Messages go through ``scaling.collectives.PipeTransport``. A send completes only once
its receiver posts the receive (gloo and NCCL p2p), so the executor leaves sends in
flight (as ``torch.distributed.pipelining`` does): an instruction returns once its
receives are done, and the step waits for the outstanding sends after its last
instruction, where a send that never completes is reported with its peer. Schedules
are still checked deadlock-free with blocking sends (the simulator's ``rendezvous``
mode), which is the stricter case. An ``Exchange`` runs as one batched call of up to
four transfers. With virtual stages the transport is a ring (last stage -> first stage).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from scaling.collectives import PipeTransport, tensors_requiring_grad
from scaling.pipeline._instructions import (
    Backward,
    BackwardInput,
    BackwardWeight,
    Exchange,
    Forward,
    Instruction,
    LoadMicroBatch,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
)
from scaling.pipeline._results import abandon_result_broadcast, gather_results, post_result_receive
from scaling.pipeline.schedules import forward_only_schedule

if TYPE_CHECKING:
    from scaling.pipeline._parallel_module import ParallelModule


class OptimizerLike(Protocol):
    """What ``train_step`` needs of an optimizer (``scaling.optim.Optimizer`` has it)."""

    def zero_grad(self) -> None: ...
    def backward(self, loss: torch.Tensor) -> None: ...
    def step(self) -> Any: ...


LossFunction = Callable[[Any, Any], tuple[torch.Tensor, dict[str, Any]]]
MetricsAggregation = Callable[[Any, list[dict[str, Any]]], dict[str, Any]]
SyncBatch = Callable[[Any, Any], Any]


@dataclasses.dataclass(frozen=True)
class TrainStepOutput:
    """Result of one ``train_step`` / ``evaluation_step``, the same on every rank.

    Attributes:
        loss: mean loss over micro-batches and data-parallel ranks.
        metrics: aggregated metrics (floats).
        global_grad_norm: from the optimizer step (None in evaluation or if not reported).
        learning_rates: per parameter group (empty in evaluation).
        loss_scale: the loss scale after the step (None in evaluation).
        step_duration: wall-clock seconds of the step on this rank.
    """

    loss: float
    metrics: dict[str, float]
    global_grad_norm: float | None
    learning_rates: dict[str, float]
    loss_scale: float | None
    step_duration: float


def _grad_leaves(obj: Any) -> list[torch.Tensor]:
    # The transport's flatten order, so gradients line up with what the peer received.
    return tensors_requiring_grad(obj)


def _detach_for_next_chunk(obj: Any) -> Any:
    """A copy whose float tensors are fresh leaves, as if the object had been sent."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().requires_grad_(obj.requires_grad)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(
            obj, **{f.name: _detach_for_next_chunk(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
        )
    if isinstance(obj, (list, tuple)):
        return type(obj)(_detach_for_next_chunk(x) for x in obj)
    if isinstance(obj, dict):
        return {k: _detach_for_next_chunk(v) for k, v in obj.items()}
    return obj


def _pipe_transport(module: ParallelModule) -> PipeTransport:
    """The module's transport for this kind of step, made on first use and kept.

    Its metadata cache then spans steps: after the first step every message is one
    transfer (no handshake), as long as shapes do not change. Forward-only steps (no
    gradients recorded: evaluation) have a transport of their own, since their activations
    do not require grad: alternating training and evaluation changes neither cache, and
    with ``static_shapes`` each kind of step keeps its own fixed shapes.
    """
    attr = "_pipe_transport" if torch.is_grad_enabled() else "_pipe_transport_no_grad"
    transport: PipeTransport | None = getattr(module, attr, None)
    if transport is None:
        topo, s, p = module.topology, module.stage, module.num_stages
        static = bool(getattr(module, "static_shapes", False))
        if module.num_virtual_stages > 1:
            # Virtual stages form a ring: the last stage feeds the first stage's next chunk.
            dp, tp = topo.data_parallel_rank, topo.model_parallel_rank
            prev_rank, next_rank = topo.rank_of((s - 1) % p, dp, tp), topo.rank_of((s + 1) % p, dp, tp)
            transport = PipeTransport(prev_rank, next_rank, topo.device, ring=True, static_shapes=static)
        else:
            transport = PipeTransport(topo.previous_pipe_rank, topo.next_pipe_rank, topo.device, static_shapes=static)
        setattr(module, attr, transport)
    return transport


class StageExecutor:
    """Runs instructions for one stage; holds the per-(micro-batch, chunk) buffers."""

    def __init__(
        self,
        module: ParallelModule,
        micro_batches: Sequence[Any],
        loss_function: LossFunction,
        optimizer: OptimizerLike | None,
        sync: SyncBatch | None,
    ) -> None:
        self.module, self.micro_batches, self.loss_function = module, micro_batches, loss_function
        self.optimizer, self.sync = optimizer, sync
        self.p, self.s = module.num_stages, module.stage
        self.last_vs = self.p * module.num_virtual_stages - 1
        self.batches: dict[int, Any] = {}
        self.inputs: dict[tuple[int, int], Any] = {}
        self.outputs: dict[tuple[int, int], Any] = {}
        self.grads_out: dict[tuple[int, int], list[torch.Tensor]] = {}  # gradient w.r.t. each output
        self.grads_in: dict[tuple[int, int], list[torch.Tensor]] = {}  # gradient w.r.t. each input
        self.losses: dict[int, torch.Tensor] = {}
        self.metrics: dict[int, dict[str, Any]] = {}
        self.step_output: Any = None
        self.transport: Any = None
        if self.p > 1:
            self.transport = _pipe_transport(module)
        # The step results' receive (stages other than the last): posted just before this
        # stage first waits for a message, when it is idle anyway (see _results.py).
        self.posted_results: Any = None
        self._results_to_post = True

    def post_results(self) -> None:
        """Post this stage's receive of the step results, once (see :func:`post_result_receive`)."""
        if self._results_to_post:
            self._results_to_post = False
            self.posted_results = post_result_receive(self.module)

    def run_and_gather(self, instructions: Sequence[Instruction], aggregate: Any) -> tuple[float, dict[str, float]]:
        """:meth:`run`, then the step's loss and metrics on every rank (see ``_results.py``).

        If the instructions raise, this rank still does its part of the step-result
        broadcast (the last stage sends it flagged as aborted, the others post their
        receive), so every rank keeps one per step and a later step pairs up with the
        right one; then the exception propagates.
        """
        try:
            self.run(instructions)
        except BaseException:
            if self.module.topology.is_last_pipe_stage:
                abandon_result_broadcast(self.module)
            else:
                self.post_results()
            raise
        self.post_results()  # a stage that never waited for a message posts it now
        return gather_results(self, aggregate, self.posted_results)

    def _vs(self, chunk: int) -> int:
        return chunk * self.p + self.s

    def run(self, instructions: Sequence[Instruction]) -> None:
        """Execute ``instructions`` in order.

        When the module has a list attribute ``instruction_timings`` (the trainer's profiler
        sets one for its step window), each instruction runs inside
        ``torch.profiler.record_function(repr(ins))`` and ``(repr(ins), start, end)`` in
        ``time.perf_counter()`` seconds is appended to it. Without it (the default) the loop
        is the plain dispatch: one dict look-up of the handler per instruction. Sends stay
        in flight; after the last instruction ``run`` waits for them.
        """
        timings = getattr(self.module, "instruction_timings", None)
        handlers: dict[type, Callable[[Any], None]] = {}
        for ins in instructions:
            handler = handlers.get(type(ins))
            if handler is None:
                handler = handlers[type(ins)] = getattr(self, f"_{type(ins).__name__}")
            if timings is None:
                handler(ins)
                continue
            name = repr(ins)
            with torch.profiler.record_function(name):
                start = time.perf_counter()
                handler(ins)
                end = time.perf_counter()
            timings.append((name, start, end))
        if self.transport is not None:
            self.transport.wait_sends()  # the sends left in flight by the instructions above

    # ---------------------------------------------------------------- data
    def _LoadMicroBatch(self, ins: LoadMicroBatch) -> None:
        batch = self.micro_batches[ins.micro_batch]
        if self.sync is not None:
            batch = self.sync(self.module.topology, batch)
        self.batches[ins.micro_batch] = batch

    # ---------------------------------------------------------------- compute
    def _Forward(self, ins: Forward) -> None:
        key, vs = (ins.micro_batch, ins.chunk), self._vs(ins.chunk)
        if vs == 0:
            batch = self.batches[ins.micro_batch]
            x = batch.only_inputs() if hasattr(batch, "only_inputs") else batch
        elif self.p == 1:
            x = _detach_for_next_chunk(self.outputs[(ins.micro_batch, ins.chunk - 1)])
        else:
            x = self.inputs[key]
        self.inputs[key] = x
        out = self.module.forward_chunk(ins.chunk, x)
        if vs == self.last_vs:
            batch = self.batches[ins.micro_batch]
            targets = batch.only_targets() if hasattr(batch, "only_targets") else batch
            loss, metrics = self.loss_function(out, targets)
            num = len(self.micro_batches)
            self.losses[ins.micro_batch] = loss.detach()
            self.metrics[ins.micro_batch] = metrics
            out = loss / num  # gradient accumulation: the step's loss is the mean over micro-batches
        self.outputs[key] = out

    def _roots(self, key: tuple[int, int], scaled: bool) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        vs = self._vs(key[1])
        if vs == self.last_vs:
            scale = float(getattr(getattr(self.optimizer, "loss_scaler", None), "scale", 1.0)) if scaled else 1.0
            return [self.outputs[key] * scale], None
        if self.p == 1:
            return _grad_leaves(self.outputs[key]), self.grads_in.pop((key[0], key[1] + 1))
        return _grad_leaves(self.outputs[key]), self.grads_out.pop(key)

    def _Backward(self, ins: Backward) -> None:
        key = (ins.micro_batch, ins.chunk)
        if self._vs(ins.chunk) == self.last_vs and self.optimizer is not None:
            self.optimizer.backward(self.outputs[key])  # applies the loss scale
        else:
            roots, grads = self._roots(key, scaled=True)
            torch.autograd.backward(roots, grads)
        leaves = _grad_leaves(self.inputs.pop(key))
        self.grads_in[key] = [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves]
        self.outputs.pop(key)

    def _BackwardInput(self, ins: BackwardInput) -> None:
        key = (ins.micro_batch, ins.chunk)
        roots, grads = self._roots(key, scaled=True)
        leaves = _grad_leaves(self.inputs[key])
        got = torch.autograd.grad(roots, leaves, grads, retain_graph=True, allow_unused=True) if leaves else ()
        self.grads_in[key] = [g if g is not None else torch.zeros_like(t) for g, t in zip(got, leaves)]
        # The weight pass reuses the graph with the same output gradients.
        self.inputs[key] = (roots, grads)

    def _BackwardWeight(self, ins: BackwardWeight) -> None:
        key = (ins.micro_batch, ins.chunk)
        roots, grads = self.inputs.pop(key)
        self.outputs.pop(key)
        params = [
            p for i in self.module.chunks[ins.chunk] for p in self.module.layers[str(i)].parameters() if p.requires_grad
        ]
        got = torch.autograd.grad(roots, params, grads, allow_unused=True)
        for param, g in zip(params, got):
            if g is not None:
                param.grad = g if param.grad is None else param.grad + g

    # ---------------------------------------------------------------- messages
    def _SendActivation(self, ins: SendActivation) -> None:
        self.transport.send_forward(self.outputs[(ins.micro_batch, ins.chunk)], wait=False)

    def _RecvActivation(self, ins: RecvActivation) -> None:
        self.post_results()
        self.inputs[(ins.micro_batch, ins.chunk)] = self.transport.recv_forward()

    def _SendGrad(self, ins: SendGrad) -> None:
        self.transport.send_backward(self.grads_in.pop((ins.micro_batch, ins.chunk)), wait=False)

    def _RecvGrad(self, ins: RecvGrad) -> None:
        self.post_results()
        self.grads_out[(ins.micro_batch, ins.chunk)] = list(self.transport.recv_backward())

    def _Exchange(self, ins: Exchange) -> None:
        # Any mix of the four transfers (1F1B pairs; interleaved rounds post up to all four).
        kwargs: dict[str, Any] = {"wait_sends": False}
        recv_forward = recv_backward = None
        for op in ins.ops:
            key = (op.micro_batch, op.chunk)  # type: ignore[attr-defined]
            kind = type(op)
            if kind is SendActivation:
                kwargs["send_forward"] = self.outputs[key]
            elif kind is SendGrad:
                kwargs["send_backward"] = self.grads_in.pop(key)
            elif kind is RecvActivation:
                kwargs["recv_forward"], recv_forward = True, key
            elif kind is RecvGrad:
                kwargs["recv_backward"], recv_backward = True, key
            else:
                raise NotImplementedError(f"{ins!r}: {op!r} is not a transfer")
        if recv_forward is not None or recv_backward is not None:
            self.post_results()
        forward, backward = self.transport.exchange(**kwargs)
        if recv_forward is not None:
            self.inputs[recv_forward] = forward
        if recv_backward is not None:
            self.grads_out[recv_backward] = list(backward)

    # ---------------------------------------------------------------- step
    def _ReduceTiedGrads(self, ins: ReduceTiedGrads) -> None:
        # An optimizer that averages gradients over DP during backward must finish that
        # first: it adds its averages into .grad later, which would undo the tied sum.
        finish = getattr(self.optimizer, "finish_gradient_reduction", None)
        if finish is not None:
            finish()
        self.module.reduce_tied_gradients()

    def _OptimizerStep(self, ins: OptimizerStep) -> None:
        assert self.optimizer is not None
        self.step_output = self.optimizer.step()


def run_train_step(
    module: ParallelModule,
    micro_batches: Sequence[Any],
    optimizer: OptimizerLike,
    loss_function: LossFunction,
    aggregate: MetricsAggregation | None,
    sync: SyncBatch | None,
) -> TrainStepOutput:
    """See :meth:`ParallelModule.train_step`."""
    start = time.perf_counter()
    if not module.training:  # train() walks every submodule: only when needed, not every step
        module.train()
    optimizer.zero_grad()
    ex = StageExecutor(module, list(micro_batches), loss_function, optimizer, sync)
    extra = (module.num_virtual_stages,) if module.schedule_name == "interleaved_1f1b" else ()
    loss, metrics = ex.run_and_gather(
        module.schedule_fn(module.num_stages, len(ex.micro_batches), module.stage, *extra), aggregate
    )
    out = ex.step_output
    return TrainStepOutput(
        loss=loss,
        metrics=metrics,
        global_grad_norm=getattr(out, "global_grad_norm", None),
        learning_rates=dict(getattr(out, "learning_rates", {}) or {}),
        loss_scale=getattr(out, "current_loss_scale", getattr(out, "loss_scale", None)),
        step_duration=time.perf_counter() - start,
    )


def run_evaluation_step(
    module: ParallelModule,
    micro_batches: Sequence[Any],
    loss_function: LossFunction,
    aggregate: MetricsAggregation | None,
    sync: SyncBatch | None,
) -> TrainStepOutput:
    """See :meth:`ParallelModule.evaluation_step`."""
    start = time.perf_counter()
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            ex = StageExecutor(module, list(micro_batches), loss_function, None, sync)
            schedule = forward_only_schedule(
                module.num_stages, len(ex.micro_batches), module.stage, module.num_virtual_stages
            )
            loss, metrics = ex.run_and_gather(schedule, aggregate)
    finally:
        module.train(was_training)
    return TrainStepOutput(loss, metrics, None, {}, None, time.perf_counter() - start)
