"""ParallelModule: build this pipeline stage's layers from the model's LayerSpec list, run its schedule."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence

import torch

from scaling.collectives import PyTree
from scaling.config import Metrics
from scaling.nn import (
    ColumnParallelLinear,
    CompileConfig,
    LayerInputError,
    LayerSpec,
    ParameterMeta,
    TiedLayerSpec,
    compile_layers,
    get_parameter_meta,
    set_layer_index,
)
from scaling.pipeline._executor import (
    InstructionTimings,
    LossBackward,
    LossFunction,
    PhaseMark,
    StageExecutor,
    StageOutputs,
    StageTransports,
)
from scaling.pipeline._instructions import stage_of, virtual_stage
from scaling.pipeline._partition import count_parameters, partition_layers
from scaling.pipeline._tied import TiedGroups
from scaling.pipeline.schedules import SCHEDULES, forward_only_schedule
from scaling.pipeline.schedules._common import placement_of
from scaling.topology import Topology

logger = logging.getLogger(__name__)
DEFAULT_SEED = 42  # the per-layer seeds' base when neither the caller nor seed_all gave one


class ParallelModule(torch.nn.Module):
    """The local pipeline stage of a model declared as a list of ``LayerSpec``s.

    Only the layers of this rank's stage are built. :meth:`run_schedule` runs the
    configured schedule over a list of micro-batches (forward, backward, transfers);
    the training step around it (batch placement, tied-gradient reduction, the update,
    the step's results) is ``scaling.trainer.train_step``. Before building layer ``i`` the
    default torch generator is seeded with ``seed + i`` (inside ``fork_rng``, so the
    caller's stream is untouched): every layout starts from the same weights. Parameter
    names are layout-independent: ``layers.{i}.{name inside the layer}``.

    Args:
        layer_specs: the whole model, in order (``LayerSpec`` / ``TiedLayerSpec``).
        topology: ranks and process groups; ``pipe_parallel_size`` stages.
        partition_method: ``"uniform"``, ``"parameters"``, ``"cost"`` or ``"explicit"``
            (see :func:`partition_layers`).
        partition_boundaries: layer indices for ``"explicit"``.
        layer_costs: per-layer cost estimates for ``"cost"`` (FLOPs or a measured profile).
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``, ``"zb_h1"`` or ``"zb_v"``
            (two chunks per stage in a V: stage ``s`` holds virtual stages ``s`` and ``2p - 1 - s``).
        num_virtual_stages: model chunks per stage (``> 1`` only with ``"interleaved_1f1b"``;
            ``"zb_v"`` always runs 2, and 1 or 2 may be given).
        seed: base seed of the per-layer initialisation; default: the run's seed
            (``topology.seed``, set by ``seed_all`` / ``BaseContext.initialize`` from
            ``TrainerConfig.seed``), or 42 when nothing seeded the topology.
        static_shapes: every micro-batch's activations have the same structure, shapes and
            dtypes (the default of torch's pipeline schedules and of Megatron-LM without
            ``--variable-seq-lengths``): after the first hand-off on each channel (the
            cache spans steps), messages carry no header, which saves a little per
            hand-off; a changed shape then raises ``ValueError`` on the sending stage.
            Training and evaluation steps keep separate shapes. Default ``False``: shapes
            may change between micro-batches.
        compile: compile each layer's forward with ``torch.compile`` (a
            :class:`~scaling.nn.CompileConfig`, or True for its defaults); identical
            layers share one compiled graph. Default: eager.

    Raises:
        ValueError: unknown schedule, virtual stages without interleaving, or a bad partition.

    Example::

        module = ParallelModule(layer_specs=specs, topology=topology, schedule="1f1b")
        outputs = module.run_schedule(micro_batches, loss_function)  # or scaling.trainer.train_step
    """

    def __init__(
        self,
        layer_specs: Sequence[LayerSpec],
        topology: Topology,
        *,
        partition_method: str = "uniform",
        partition_boundaries: Sequence[int] | None = None,
        layer_costs: Sequence[float] | None = None,
        schedule: str = "1f1b",
        num_virtual_stages: int = 1,
        seed: int | None = None,
        static_shapes: bool = False,
        compile: CompileConfig | bool = False,
    ) -> None:
        super().__init__()
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule={schedule!r} is unknown; choose one of {sorted(SCHEDULES)}")
        if schedule == "zb_v" and num_virtual_stages in (1, 2):
            num_virtual_stages = 2
        elif num_virtual_stages != 1 and schedule != "interleaved_1f1b":
            raise ValueError(
                f"num_virtual_stages={num_virtual_stages} needs schedule='interleaved_1f1b' (got {schedule!r}"
                + ("; zb_v runs exactly 2)" if schedule == "zb_v" else ")")
            )
        self.topology = topology
        self.static_shapes = static_shapes
        #: When a list, :meth:`run_schedule` appends ``(repr(instruction), start, end)`` per
        #: instruction (the trainer's profiler sets one for its window).
        self.instruction_timings: InstructionTimings | None = None
        self.schedule_name = schedule
        self.schedule_fn = SCHEDULES[schedule]
        #: Where this stage's chunks sit in the model (``scaling.pipeline.virtual_stage``).
        self.placement = placement_of(self.schedule_fn)
        self.num_stages = topology.axis("pp").size
        self.stage = topology.axis("pp").rank
        self.num_virtual_stages = num_virtual_stages
        self.transports = StageTransports(topology, num_virtual_stages, static_shapes)
        self.layer_specs = list(layer_specs)
        weights = count_parameters(self.layer_specs) if partition_method == "parameters" else layer_costs
        self.partition = partition_layers(
            len(self.layer_specs),
            self.num_stages,
            partition_method,
            num_virtual=num_virtual_stages,
            weights=weights,
            boundaries=partition_boundaries,
        )
        if topology.global_rank == 0:
            logger.info("pipeline partition (virtual stage -> layers): %s", self.describe_partition())
        #: The stage that computes the loss (holds the last virtual stage): the last one, or 0 in a V.
        self.loss_stage = stage_of(self.num_stages * num_virtual_stages - 1, self.num_stages, self.placement)[0]
        #: The stages that read batches: the first (the inputs) and the loss's (the targets).
        self.data_stages = (0, self.loss_stage)
        self.chunks: list[range] = [
            self.partition[virtual_stage(self.stage, c, self.num_stages, self.placement)]
            for c in range(num_virtual_stages)
        ]
        self.layers = torch.nn.ModuleDict()
        if seed is None:
            seed = topology.seed if topology.seed is not None else DEFAULT_SEED
        for r in self.chunks:
            for i in r:
                self.layers[str(i)] = self._build_layer(i, seed)
        self._tie_local_copies()
        #: How each layer's forward is compiled (``torch.compile`` per layer; see scaling.nn.compile_layer).
        self.compile_config = compile if isinstance(compile, CompileConfig) else CompileConfig(enabled=compile)
        compile_layers(self.layers.values(), self.compile_config)
        self._loss_hint = self._split_output_hint()
        self._tied = TiedGroups(topology, self._tied_stage_map())
        self._tied.broadcast_values(self._tied_params().__getitem__)

    # ------------------------------------------------------------ building
    def _build_layer(self, index: int, seed: int) -> torch.nn.Module:
        device = self.topology.device
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed + index)
            module = self.layer_specs[index].initialize()
        set_layer_index(module, index)
        return module.to(device)

    def describe_partition(self) -> str:
        """``"stage 0: layers 0-2 | stage 1: layers 3-5"`` (virtual stages as ``stage s.c``)."""
        parts = []
        for vs, r in enumerate(self.partition):
            s, c = stage_of(vs, self.num_stages, self.placement)
            name = f"stage {s}" + (f".{c}" if self.num_virtual_stages > 1 else "")
            parts.append(f"{name}: layers {r.start}-{r.stop - 1}")
        return " | ".join(parts)

    def _tied_params(self) -> dict[str, list[torch.nn.Parameter]]:
        tied: dict[str, list[torch.nn.Parameter]] = {}
        for _, param, meta in self.named_parameters_with_meta():
            if meta.tied_key is not None:
                tied.setdefault(meta.tied_key, []).append(param)
        return tied

    def _tie_local_copies(self) -> None:
        # Copies of one tied weight on the same stage become one Parameter, so autograd
        # sums their gradients exactly as in a one-process model.
        first: dict[tuple[str, str], torch.nn.Parameter] = {}
        for i, module in self.layers.items():
            spec = self.layer_specs[int(i)]
            if not isinstance(spec, TiedLayerSpec):
                continue
            for path in spec.tied_weight_attributes:
                owner_path, _, attr = path.rpartition(".")
                owner = module.get_submodule(owner_path) if owner_path else module
                key = (spec.key, path)
                if key in first:
                    setattr(owner, attr, first[key])
                else:
                    first[key] = getattr(owner, attr)

    def _tied_stage_map(self) -> dict[str, list[int]]:
        stages: dict[str, list[int]] = {}
        for vs, r in enumerate(self.partition):
            for i in r:
                spec = self.layer_specs[i]
                stage = stage_of(vs, self.num_stages, self.placement)[0]
                if isinstance(spec, TiedLayerSpec) and stage not in stages.setdefault(spec.key, []):
                    stages[spec.key].append(stage)
        return {k: sorted(v) for k, v in sorted(stages.items()) if len(v) > 1}

    def tied_copies(self) -> dict[str, list[str]]:
        """Every tied weight's checkpoint key -> the keys of its copies in the other layers of its
        group (``layers.{j}.{path}``), over the whole model, whichever stage holds them.

        A checkpoint saved with one stage holds a tied weight once; the checkpointer reads a stage's
        missing copy from one of these (``load_checkpoint(aliases=...)``).
        """
        groups: dict[tuple[str, str], list[str]] = {}
        for i, spec in enumerate(self.layer_specs):
            if isinstance(spec, TiedLayerSpec):
                for path in spec.tied_weight_attributes:
                    groups.setdefault((spec.key, path), []).append(f"layers.{i}.{path}")
        return {key: [k for k in keys if k != key] for keys in groups.values() if len(keys) > 1 for key in keys}

    def reduce_tied_gradients(self) -> None:
        """Sum the gradients of tied weights over the stages that hold a copy."""
        if self._tied:  # nothing tied across stages: skip the walk over every parameter
            self._tied.reduce_gradients(self._tied_params().__getitem__)

    # ------------------------------------------------------------ parameters
    def named_parameters_with_meta(self) -> Iterator[tuple[str, torch.nn.Parameter, ParameterMeta]]:
        """Yield ``(f"layers.{i}.{name}", parameter, meta)`` for this stage's parameters (shared ones once)."""
        for name, param in self.named_parameters():
            yield name, param, get_parameter_meta(param)

    def layer_modules(self) -> list[torch.nn.Module]:
        """This stage's layers in forward order (chunk by chunk): the units ZeRO-3 gathers one at a time."""
        return [self.layers[str(i)] for r in self.chunks for i in r]

    def chunk_parameters(self, chunk: int) -> list[torch.nn.Parameter]:
        """The trainable parameters of local ``chunk``'s layers (the weight-gradient pass's)."""
        return [p for i in self.chunks[chunk] for p in self.layers[str(i)].parameters() if p.requires_grad]

    # ------------------------------------------------------------ forward
    def forward_chunk(self, chunk: int, x: PyTree) -> PyTree:
        """Run the layers of local ``chunk`` on ``x`` (a LayerIO).

        Raises:
            LayerInputError: a layer got an input of the wrong shape (its index and class named).
        """
        for i in self.chunks[chunk]:
            layer = self.layers[str(i)]
            try:
                x = layer(x)
            except LayerInputError as exc:
                raise LayerInputError(f"layer {i} ({type(layer).__name__}): {exc}") from exc
        return x

    def _split_output_hint(self) -> str | None:
        """What to tell a user whose loss fails on a last layer that returns TP-split features, if it does."""
        last = str(len(self.layer_specs) - 1)
        tp = self.topology.axis("tp").size
        if last not in self.layers or tp == 1:
            return None
        split = [
            (name, m)
            for name, m in self.layers[last].named_modules()
            if isinstance(m, ColumnParallelLinear) and m.parallel_output
        ]
        if not split:
            return None
        name, linear = split[-1]
        return (
            f"the loss function failed on the output of the last layer (layer {last}, "
            f"{type(self.layers[last]).__name__}), which is split over tensor parallelism: its ColumnParallelLinear "
            f"{name!r} has parallel_output=True at model_parallel_size={tp}, so each rank's output holds "
            f"{linear.out_features // tp} of its {linear.out_features} features. Set parallel_output=False on "
            "that layer, or compute the loss with scaling.nn.vocab_parallel_cross_entropy (it takes split logits)"
        )

    def _explained(self, loss_function: LossFunction) -> LossFunction:
        """``loss_function``, whose failure on a last layer's split output says so."""
        hint = self._loss_hint
        if hint is None:
            return loss_function

        def checked(output: PyTree, targets: PyTree) -> tuple[torch.Tensor, Metrics]:
            try:
                return loss_function(output, targets)
            except (IndexError, RuntimeError, ValueError) as exc:
                raise ValueError(f"{hint}; the error was: {type(exc).__name__}: {exc}") from exc

        return checked

    def forward(self, batch: PyTree) -> PyTree:
        """Whole-model forward in one process (``pipe_parallel_size == 1`` only).

        Raises:
            RuntimeError: with more than one pipeline stage; use :meth:`run_schedule` there
                (``scaling.trainer.train_step`` / ``evaluation_step`` do).
        """
        if self.num_stages != 1:
            raise RuntimeError(
                f"ParallelModule.forward runs the whole model and needs pipe_parallel_size=1 "
                f"(got {self.num_stages}); use run_schedule (scaling.trainer.train_step / evaluation_step do)"
            )
        x = batch.only_inputs() if hasattr(batch, "only_inputs") else batch
        for c in range(self.num_virtual_stages):
            x = self.forward_chunk(c, x)
        return x

    # ------------------------------------------------------------ schedule
    def run_schedule(
        self,
        micro_batches: Sequence[PyTree],
        loss_function: LossFunction,
        *,
        forward_only: bool = False,
        loss_backward: LossBackward | None = None,
        loss_scale: float = 1.0,
        before_first_wait: Callable[[], object] | None = None,
        mark: PhaseMark | None = None,
    ) -> StageOutputs:
        """Run this stage's part of the configured schedule over ``micro_batches``.

        Forward and backward of every micro-batch (gradients accumulate into ``.grad``,
        each micro-batch's loss divided by their number) and the transfers to the
        neighbouring stages; with ``forward_only`` the forward-only schedule under
        ``torch.no_grad()``. Nothing else: no update, no tied-gradient sum (see
        :meth:`reduce_tied_gradients`), no result broadcast.

        Args:
            micro_batches: one batch per micro-batch, on the device and synced over TP
                (``len`` is the number of micro-batches on every rank; stages other than
                the first and last never read them, so they may hold ``None`` there).
            loss_function: ``(last_layer_output, batch.only_targets()) -> (loss, metrics)``.
            forward_only: evaluation: no backward.
            loss_backward: back-propagates a micro-batch's loss (e.g. a mixed-precision
                backward that applies a loss scale); default ``loss.backward()``.
            loss_scale: the scale ``loss_backward`` applies (the ``zb_h1`` schedule's split
                backward differentiates the loss itself).
            before_first_wait: called once, right before this stage first waits for a message.
            mark: told the phase (``"forward"``, ``"backward"``, ``"transfer"``) of each
                instruction before it runs (a straggler timer's marks).

        Returns:
            :class:`StageOutputs`: losses and metrics per micro-batch on the last stage.
        """
        n = len(micro_batches)
        loss_function = self._explained(loss_function)
        if forward_only:
            with torch.no_grad():
                instructions = forward_only_schedule(
                    self.num_stages, n, self.stage, self.num_virtual_stages, self.placement
                )
                return self._executor(micro_batches, loss_function, None, 1.0, before_first_wait, mark).run(
                    instructions
                )
        extra = (self.num_virtual_stages,) if self.num_virtual_stages > 1 else ()
        instructions = self.schedule_fn(self.num_stages, n, self.stage, *extra)
        return self._executor(micro_batches, loss_function, loss_backward, loss_scale, before_first_wait, mark).run(
            instructions
        )

    def _executor(
        self,
        micro_batches: Sequence[PyTree],
        loss_function: LossFunction,
        loss_backward: LossBackward | None,
        loss_scale: float,
        before_first_wait: Callable[[], object] | None,
        mark: PhaseMark | None = None,
    ) -> StageExecutor:
        transport = self.transports.get(torch.is_grad_enabled()) if self.num_stages > 1 else None
        return StageExecutor(
            self,
            list(micro_batches),
            loss_function,
            transport,
            loss_backward=loss_backward,
            loss_scale=loss_scale,
            before_first_wait=before_first_wait,
            timings=self.instruction_timings,
            mark=mark,
            placement=self.placement,
        )
