"""The executor: run one stage's instruction list with real tensors and real messages.

It runs forward passes (with the loss on the last virtual stage), backward passes (whole,
or split into input and weight parts) and the transfers between stages, and nothing else:
placing batches, reducing tied gradients, the update and the step's results are the
caller's (``scaling.trainer``'s step). A stage is anything that satisfies
:class:`PipelineStage`; the loss's backward and the loss scale come in as arguments.

Messages go through ``scaling.collectives.PipeTransport``. A send completes only once
its receiver posts the receive (gloo and NCCL p2p), so the executor leaves sends in
flight (as ``torch.distributed.pipelining`` does): an instruction returns once its
receives are done, and the run waits for the outstanding sends after its last
instruction, where a send that never completes is reported with its peer. Schedules
are still checked deadlock-free with blocking sends (the simulator's ``rendezvous``
mode), which is the stricter case. An ``Exchange`` runs as one batched call of up to
four transfers. With virtual stages the transport is a ring (last stage -> first stage).
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from scaling.collectives import PipeTransport, PyTree, tensors_requiring_grad
from scaling.config import Metrics
from scaling.pipeline._instructions import (
    Backward,
    BackwardInput,
    BackwardWeight,
    Exchange,
    Forward,
    Instruction,
    LoadMicroBatch,
    RecvActivation,
    RecvGrad,
    SendActivation,
    SendGrad,
    stage_of,
    virtual_stage,
)
from scaling.pipeline._weight_pass import WeightPass
from scaling.topology import Topology


class PipelineStage(Protocol):
    """What the executor needs of a stage (``ParallelModule``, the high-level API's stage)."""

    topology: Topology
    num_stages: int
    stage: int
    num_virtual_stages: int

    def forward_chunk(self, chunk: int, x: PyTree) -> PyTree:
        """Run local model chunk ``chunk`` on ``x`` (a micro-batch's inputs or a received activation)."""
        ...

    def chunk_parameters(self, chunk: int) -> list[torch.nn.Parameter]:
        """The trainable parameters of local chunk ``chunk`` (the weight-gradient pass reads them)."""
        ...


LossFunction = Callable[[PyTree, PyTree], tuple[torch.Tensor, Metrics]]
LossBackward = Callable[[torch.Tensor], None]
InstructionTimings = list[tuple[str, float, float]]
#: ``mark(phase)``: the step's phase timer is told which phase the next instruction is in.
PhaseMark = Callable[[str], None]
#: The phase of each kind of instruction; every other kind (messages) is ``"transfer"``.
PHASE_OF: dict[type, str] = {
    Forward: "forward",
    LoadMicroBatch: "forward",
    Backward: "backward",
    BackwardInput: "backward",
    BackwardWeight: "backward",
}


@dataclasses.dataclass(frozen=True)
class StageOutputs:
    """What a stage computed in one run: per micro-batch, the loss (detached) and the loss
    function's metrics, on the last virtual stage's rank; empty on every other stage."""

    losses: dict[int, torch.Tensor]
    metrics: dict[int, Metrics]


def _grad_leaves(obj: PyTree) -> list[torch.Tensor]:
    # The transport's flatten order, so gradients line up with what the peer received.
    return tensors_requiring_grad(obj)


def _detach_for_next_chunk(obj: PyTree) -> PyTree:
    """A copy whose float tensors are fresh leaves, as if the object had been sent."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().requires_grad_(obj.requires_grad)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(
            obj, **{f.name: _detach_for_next_chunk(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
        )
    if hasattr(obj, "__dict__") and not isinstance(obj, (type, torch.nn.Module)):  # a plain LayerIO class
        copied = copy.copy(obj)
        copied.__dict__.update({k: _detach_for_next_chunk(v) for k, v in vars(obj).items()})
        return copied
    if isinstance(obj, (list, tuple)):
        return type(obj)(_detach_for_next_chunk(x) for x in obj)
    if isinstance(obj, dict):
        return {k: _detach_for_next_chunk(v) for k, v in obj.items()}
    return obj


class StageTransports:
    """A stage's transports to its neighbours, made on first use and kept.

    Their metadata caches then span steps: after the first step every message is one
    transfer (no handshake), as long as shapes do not change. Forward-only runs (no
    gradients recorded: evaluation) have a transport of their own, since their activations
    do not require grad: alternating training and evaluation changes neither cache, and
    with ``static_shapes`` each kind of run keeps its own fixed shapes. With virtual stages
    the stages form a ring: the last stage feeds the first stage's next chunk.

    Args:
        topology: this rank's topology (its pipe neighbours and device).
        num_virtual_stages: model chunks per stage.
        static_shapes: see :class:`scaling.collectives.PipeTransport`.
    """

    def __init__(self, topology: Topology, num_virtual_stages: int = 1, static_shapes: bool = False) -> None:
        self.topology, self.num_virtual_stages, self.static_shapes = topology, num_virtual_stages, static_shapes
        self.training: PipeTransport | None = None
        self.forward_only: PipeTransport | None = None

    def get(self, grad_enabled: bool) -> PipeTransport:
        """The transport for a run with (training) or without (forward-only) gradients."""
        transport = self.training if grad_enabled else self.forward_only
        if transport is None:
            transport = self._make()
            if grad_enabled:
                self.training = transport
            else:
                self.forward_only = transport
        return transport

    def _make(self) -> PipeTransport:
        # Over the stage's PP group, as Megatron-LM and torch's pipelining send: on NCCL a
        # batched send/receive brings up its group's communicator, which the PP group's ranks
        # alone then set up (over the default group every rank of the job would have to).
        topo = self.topology
        group = topo.axis("pp").group
        if self.num_virtual_stages > 1:
            s, p = topo.axis("pp").rank, topo.axis("pp").size
            prev_rank, next_rank = topo.axis("pp").ranks[(s - 1) % p], topo.axis("pp").ranks[(s + 1) % p]
            return PipeTransport(prev_rank, next_rank, topo.device, group, ring=True, static_shapes=self.static_shapes)
        return PipeTransport(
            topo.axis("pp").previous, topo.axis("pp").next, topo.device, group, static_shapes=self.static_shapes
        )


class StageExecutor:
    """Runs instructions for one stage; holds the per-(micro-batch, chunk) buffers.

    Args:
        stage: the stage (:class:`PipelineStage`).
        micro_batches: one batch per micro-batch, already on the device and synced over
            TP (stages other than the first and last never read them: ``None`` there).
        loss_function: ``(last_layer_output, batch.only_targets()) -> (loss, metrics)``.
        transport: the stage's transport for this kind of run (``None`` with one stage).
        loss_backward: back-propagates a micro-batch's loss (e.g. a mixed-precision
            backward that multiplies it by a loss scale first); default ``loss.backward()``.
        loss_scale: the factor ``loss_backward`` applies, for the split backward
            (``BackwardInput``), which differentiates the loss itself.
        before_first_wait: called once, just before the stage first waits for a message
            (when it is idle anyway): the caller posts early receives there.
        timings: when a list, each instruction runs inside ``record_function(repr(ins))``
            and ``(repr(ins), start, end)`` in ``time.perf_counter()`` seconds is appended.
        mark: called with the phase (:data:`PHASE_OF`) before each instruction runs and
            with ``"transfer"`` before the final wait for sends in flight.
        placement: where the stage's chunks sit in the model, the schedule's
            (``"loop"`` or ``"v"``: :func:`scaling.pipeline.virtual_stage`).
    """

    def __init__(
        self,
        stage: PipelineStage,
        micro_batches: Sequence[PyTree],
        loss_function: LossFunction,
        transport: PipeTransport | None,
        *,
        loss_backward: LossBackward | None = None,
        loss_scale: float = 1.0,
        before_first_wait: Callable[[], object] | None = None,
        timings: InstructionTimings | None = None,
        mark: PhaseMark | None = None,
        placement: str = "loop",
    ) -> None:
        self.stage, self.micro_batches, self.loss_function = stage, micro_batches, loss_function
        self.placement = placement
        self.transport, self.loss_backward, self.loss_scale = transport, loss_backward, loss_scale
        self._before_first_wait, self.timings, self.mark = before_first_wait, timings, mark
        self.p, self.s = stage.num_stages, stage.stage
        self._ranks = stage.topology.axis("pp").ranks  # a message's peer stage -> its global rank
        self.last_vs = self.p * stage.num_virtual_stages - 1
        self.batches: dict[int, PyTree] = {}
        self.inputs: dict[tuple[int, int], PyTree] = {}
        self.outputs: dict[tuple[int, int], PyTree] = {}
        # gradient w.r.t. each output (None where the next stage had none to send)
        self.grads_out: dict[tuple[int, int], list[torch.Tensor | None]] = {}
        self.grads_in: dict[tuple[int, int], list[torch.Tensor]] = {}  # gradient w.r.t. each input
        self.losses: dict[int, torch.Tensor] = {}
        self.metrics: dict[int, Metrics] = {}

    def _waiting(self) -> None:
        """About to wait for a message: run ``before_first_wait`` the first time."""
        hook, self._before_first_wait = self._before_first_wait, None
        if hook is not None:
            hook()

    def _vs(self, chunk: int) -> int:
        return virtual_stage(self.s, chunk, self.p, self.placement)

    def _local_chunk(self, vs: int) -> int | None:
        """This stage's chunk holding virtual stage ``vs`` (a local hand-off), or None."""
        stage, chunk = stage_of(vs, self.p, self.placement)
        return chunk if stage == self.s else None

    def run(self, instructions: Sequence[Instruction]) -> StageOutputs:
        """Execute ``instructions`` in order; the losses and metrics computed here.

        Without ``timings`` the loop is the plain dispatch: one dict look-up of the
        handler per instruction. Sends stay in flight; after the last instruction ``run``
        waits for them.
        """
        timings, mark = self.timings, self.mark
        # Any: each handler takes its own instruction type, which a dict keyed by type cannot say.
        handlers: dict[type, Callable[[Any], None]] = {}
        for ins in instructions:
            handler = handlers.get(type(ins))
            if handler is None:
                handler = handlers[type(ins)] = getattr(self, f"_{type(ins).__name__}")
            if mark is not None:
                mark(PHASE_OF.get(type(ins), "transfer"))
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
            if mark is not None:
                mark("transfer")
            self.transport.wait_sends()  # the sends left in flight by the instructions above
        return StageOutputs(self.losses, self.metrics)

    # ---------------------------------------------------------------- data
    def _LoadMicroBatch(self, ins: LoadMicroBatch) -> None:
        self.batches[ins.micro_batch] = self.micro_batches[ins.micro_batch]

    # ---------------------------------------------------------------- compute
    def _Forward(self, ins: Forward) -> None:
        key, vs = (ins.micro_batch, ins.chunk), self._vs(ins.chunk)
        local = None if vs == 0 else self._local_chunk(vs - 1)
        if vs == 0:
            batch = self.batches[ins.micro_batch]
            x = batch.only_inputs() if hasattr(batch, "only_inputs") else batch
        elif local is not None:  # the previous virtual stage is here (one stage; the turn of a V)
            x = _detach_for_next_chunk(self.outputs[(ins.micro_batch, local)])
        else:
            x = self.inputs[key]
        self.inputs[key] = x
        out = self.stage.forward_chunk(ins.chunk, x)
        if vs == self.last_vs:
            batch = self.batches[ins.micro_batch]
            targets = batch.only_targets() if hasattr(batch, "only_targets") else batch
            loss, metrics = self.loss_function(out, targets)
            num = len(self.micro_batches)
            self.losses[ins.micro_batch] = loss.detach()
            self.metrics[ins.micro_batch] = metrics
            out = loss / num  # gradient accumulation: the step's loss is the mean over micro-batches
        self.outputs[key] = out

    def _roots(self, key: tuple[int, int]) -> tuple[list[torch.Tensor], Sequence[torch.Tensor | None] | None]:
        vs = self._vs(key[1])
        if vs == self.last_vs:
            out = self.outputs[key]
            return [out * self.loss_scale if self.loss_scale != 1.0 else out], None
        local = self._local_chunk(vs + 1)
        if local is not None:
            return _grad_leaves(self.outputs[key]), self.grads_in.pop((key[0], local))
        return _grad_leaves(self.outputs[key]), self.grads_out.pop(key)

    def _Backward(self, ins: Backward) -> None:
        key = (ins.micro_batch, ins.chunk)
        if self._vs(ins.chunk) == self.last_vs and self.loss_backward is not None:
            self.loss_backward(self.outputs[key])  # e.g. applies the loss scale
        else:
            roots, grads = self._roots(key)
            torch.autograd.backward(roots, grads)
        leaves = _grad_leaves(self.inputs.pop(key))
        self.grads_in[key] = [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves]
        self.outputs.pop(key)

    def _BackwardInput(self, ins: BackwardInput) -> None:
        key = (ins.micro_batch, ins.chunk)
        roots, grads = self._roots(key)
        leaves = _grad_leaves(self.inputs[key])
        # The weight pass starts where the parameters' gradients leave the input chain, from the
        # gradients this pass computes there (_weight_pass.py): nothing is differentiated twice.
        weights = WeightPass(roots, leaves, self.stage.chunk_parameters(ins.chunk))
        try:
            got = torch.autograd.grad(roots, leaves, grads, retain_graph=True, allow_unused=True) if leaves else ()
        finally:
            weights.stop_capturing()
        self.grads_in[key] = [g if g is not None else torch.zeros_like(t) for g, t in zip(got, leaves)]
        self.inputs[key] = (roots, grads, weights)

    def _BackwardWeight(self, ins: BackwardWeight) -> None:
        key = (ins.micro_batch, ins.chunk)
        roots, grads, weights = self.inputs.pop(key)
        # Accumulated into .grad as backward() does, so post-accumulate-grad hooks (gradient
        # reduction overlapped with backward, ZeRO-3) run as under the other schedules.
        weights.run(roots, grads)
        self.outputs.pop(key)

    # ---------------------------------------------------------------- messages
    # Every transfer names its peer stage (the schedule's ``peer``), so one transport serves
    # any placement: a V sends one chunk's activations down the stages and the other's up.
    def _SendActivation(self, ins: SendActivation) -> None:
        self._transfer((ins,))

    def _RecvActivation(self, ins: RecvActivation) -> None:
        self._transfer((ins,))

    def _SendGrad(self, ins: SendGrad) -> None:
        self._transfer((ins,))

    def _RecvGrad(self, ins: RecvGrad) -> None:
        self._transfer((ins,))

    def _Exchange(self, ins: Exchange) -> None:
        # Any mix of the four transfers (1F1B pairs; interleaved rounds post up to all four).
        self._transfer(ins.ops)

    def _transfer(self, ops: Sequence[Instruction]) -> None:
        """Post ``ops`` as one batched transfer (sends left in flight) and file what arrives."""
        ranks = self._ranks
        sends: list[tuple[str, int, PyTree]] = []
        receives: list[tuple[str, int]] = []
        keys: list[tuple[type, tuple[int, int]]] = []
        for op in ops:
            key, kind = (op.micro_batch, op.chunk), type(op)  # type: ignore[attr-defined]
            peer = ranks[op.peer]  # type: ignore[attr-defined]
            if kind is SendActivation:
                sends.append(("forward", peer, self.outputs[key]))
            elif kind is SendGrad:
                sends.append(("backward", peer, self.grads_in.pop(key)))
            elif kind in (RecvActivation, RecvGrad):
                receives.append(("forward" if kind is RecvActivation else "backward", peer))
                keys.append((kind, key))
            else:
                raise NotImplementedError(f"{op!r} is not a transfer")
        if receives:
            self._waiting()
        got = self.transport.transfer(sends, receives, wait_sends=False)  # type: ignore[union-attr]
        for (kind, key), obj in zip(keys, got):
            if kind is RecvActivation:
                self.inputs[key] = obj
            else:
                self.grads_out[key] = list(obj)
