"""parallelize: a plan plus an unmodified model -> model, optimizer, scheduler, loader."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from scaling.collectives import all_gather, all_reduce
from scaling.nn import CompileConfig, Float8Config, ParameterMeta, compile_layers, enable_float8, get_parameter_meta
from scaling.topology import Topology, TopologyConfig, zigzag_indices
from scaling.trainer._placement import on_device
from scaling.trainer.auto._context import enable as enable_context_parallel
from scaling.trainer.auto._context import sliced
from scaling.trainer.auto._deferred import is_deferred, materialize
from scaling.trainer.auto._optimizer import ParallelOptimizer, precision_dtype
from scaling.trainer.auto._pipeline import PipelineStage
from scaling.trainer.auto._plan import Plan
from scaling.trainer.auto._policy import shard_dim
from scaling.trainer.auto._split import find_blocks
from scaling.trainer.auto._tp import make_shard_fn


class ParallelModel(torch.nn.Module):
    """The user's model, split per the plan; ``model(batch)`` returns the loss.

    A mapping batch is passed as keyword arguments (``model(**batch)``), anything else
    positionally; an output with a ``loss`` attribute (``transformers``) yields that loss.

    With pipeline parallelism (``plan.pipe_parallel_size > 1``) ``model(batch)`` runs the
    whole schedule over ``plan.num_micro_batches`` micro-batches of ``batch``, forward
    *and* backward (the way DeepSpeed's ``train_batch`` and ``torch.distributed.pipelining``'s
    ``schedule.step`` do), and returns the mean micro-batch loss on every stage as a leaf
    tensor: ``loss.backward()`` is then a no-op, so the plain loop runs unchanged. Gradients
    accumulate over calls until ``optimizer.step()``. After ``model.eval()`` it runs the
    forward-only schedule (DeepSpeed's ``eval_batch``) and returns the loss, nothing accumulated.

    Under data parallelism ``model(batch)`` returns this rank's loss (as DDP does);
    :meth:`global_loss` gives the mean over the DP ranks for logging, on demand. Under
    context parallelism (a ``transformers`` causal LM) each rank computes on its slice of
    the batch's sequences; the loss it returns has the value of the whole batch's loss (what
    ``loss.item()`` prints, the same on every CP rank: one scalar all-reduce over CP) and the
    gradient of its share, so that the gradients averaged over the DP × CP ranks are the
    one-process ones (``_context.py``).
    """

    def __init__(
        self, module: torch.nn.Module, plan: Plan, topology: Topology, pipeline: PipelineStage | None = None
    ) -> None:
        super().__init__()
        self.module, self.plan, self.topology = module, plan, topology
        self.pipeline = pipeline
        self.scale_loss: Callable[[torch.Tensor], torch.Tensor] | None = None  # fp16: set by the optimizer
        #: The optimizer's ``no_sync`` of its DP reduction (set by the optimizer; None: nothing to sync).
        self.gradient_sync: Callable[[], AbstractContextManager[None]] | None = None
        #: The optimizer's context gathering every ZeRO-3 parameter (set by the optimizer; None: all whole).
        self.whole_parameters: Callable[[], AbstractContextManager[None]] | None = None
        #: How the blocks are compiled (``parallelize(compile=...)``).
        self.compile_config = CompileConfig()
        #: The modules multiplying in float8 (``parallelize(float8=...)``).
        self.float8_layers: list[str] = []

    def forward(self, batch: object) -> torch.Tensor:
        batch = on_device(batch, self.topology.device)
        cp = self.topology.axis("cp")
        if self.pipeline is not None:
            if not self.training:  # evaluation: the forward-only schedule, the batch's loss on every stage
                return self._batch_loss(self.pipeline.run(batch, forward_only=True))
            return self._batch_loss(self.pipeline.run(batch)).requires_grad_()
        if cp.size > 1:
            with sliced(batch, self.topology, self.plan.context_parallel_method) as kwargs:
                out = self.module(**kwargs)
        else:
            out = self.module(**batch) if isinstance(batch, Mapping) else self.module(batch)
        loss = getattr(out, "loss", out)
        if cp.size > 1:  # the batch's loss as the value, this rank's share as the gradient
            loss = loss + (self._batch_loss(loss) - loss.detach())
        return self.scale_loss(loss) if self.scale_loss is not None else loss

    def _batch_loss(self, share: torch.Tensor) -> torch.Tensor:
        """The whole batch's loss from this context-parallel rank's ``share`` (their mean; detached)."""
        cp = self.topology.axis("cp")
        if cp.size == 1:
            return share.detach()
        return all_reduce(share.detach().float().clone(), cp.group).div_(cp.size).to(share.dtype)

    @torch.no_grad()
    def logits(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The whole batch's logits ``[b, s, vocab]`` on every rank of this model's pipe and
        context-parallel groups, under any plan (a ``transformers`` causal LM's ``output.logits``;
        collective: every rank of those groups calls it with the same batch).

        Under tensor parallelism the LM head's output is gathered already; under pipeline
        parallelism the forward-only schedule runs and the last stage's logits are broadcast to
        the others; under context parallelism each rank computes its zigzag slice of every
        sequence and the slices are gathered back into sequence order (the sequence must divide
        by ``2 * cp``; no padding mask). The model runs in the mode it is in: call
        ``model.eval()`` first for dropout-free logits.

        Example::

            model.eval()
            logits = model.logits({"input_ids": ids})  # [b, s, vocab], the same on every rank
        """
        batch = {k: v.to(self.topology.device) for k, v in batch.items()}
        cp = self.topology.axis("cp")
        if cp.size > 1 and "labels" not in batch:  # the CP slicing shifts labels; any will do here
            batch = {**batch, "labels": batch["input_ids"]}
        if self.pipeline is not None:
            local = self.pipeline.logits(batch)
        elif cp.size > 1:
            with sliced(batch, self.topology, self.plan.context_parallel_method) as kwargs:
                local = self.module(**kwargs).logits
        else:
            local = self.module(**batch).logits
        if cp.size == 1:
            return local
        # Every CP rank's slice, back into sequence order (scaling.topology.zigzag_indices).
        gathered = all_gather(local.contiguous(), cp.group, dim=1)
        seq = gathered.shape[1]
        order = torch.cat([zigzag_indices(seq, r, cp.size, local.device) for r in range(cp.size)])
        return torch.empty_like(gathered).index_copy_(1, order, gathered)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedy decoding of ``max_new_tokens`` tokens after ``input_ids`` ``[b, s]`` under any plan:
        each step the next token is the argmax of :meth:`logits` at the last position, the same on
        every rank (collective, as :meth:`logits`). The prefix is recomputed each step (no key/value
        cache) and no stop token ends it early; under context parallelism the sequence is padded on
        the right to a multiple of ``2 * cp``, which a causal model's earlier positions never see.
        Without pipeline or context parallelism ``model.module.generate(...)`` (``transformers``'
        own, with its cache and options) runs too.

        Returns:
            ``[b, s + max_new_tokens]`` token ids on this rank's device.
        """
        ids = input_ids.to(self.topology.device)
        multiple = 2 * self.topology.axis("cp").size if self.topology.axis("cp").size > 1 else 1
        for _ in range(max_new_tokens):
            length = ids.shape[1]
            padded = torch.nn.functional.pad(ids, (0, -length % multiple))
            step = self.logits({"input_ids": padded})[:, length - 1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, step], dim=1)
        return ids

    def global_loss(self, loss: torch.Tensor) -> float:
        """The mean of ``loss`` over the data-parallel (× context-parallel) ranks: the loss one device would log.

        ``model(batch)`` returns this rank's loss, as DDP does (its gradient is what the
        optimizer averages). Call this where you log, not every step: it is one all-reduce
        over the DP × CP group (collective: every rank of it must call it).
        """
        value = loss.detach().float().reshape(1).clone()
        all_reduce(value, self.topology.axis("dp_cp").group)
        return float(value) / self.topology.axis("dp_cp").size

    def full_parameters(self) -> AbstractContextManager[None]:
        """Context in which every parameter of this rank is whole, to read or export between steps
        (as FSDP's ``summon_full_params``): under ZeRO-3 it gathers them (collective: every DP rank
        enters it) and frees them again after; otherwise nothing. Outside it a ZeRO-3 parameter holds
        only its shard, and an op on its values raises a ``RuntimeError`` naming it. Under tensor
        parallelism the parameters stay this rank's TP shards.

        Example::

            with model.full_parameters():
                print(model.module.lm_head.weight.norm())
        """
        return self.whole_parameters() if self.whole_parameters is not None else contextlib.nullcontext()

    def no_sync(self) -> AbstractContextManager[None]:
        """As DDP's ``no_sync``: backward passes inside accumulate gradients on each rank, and
        the first backward after it (or ``optimizer.step()``) averages the sum over DP once.

        For gradient accumulation over several ``model(batch)`` calls per step, run all but
        the last inside it: the DP traffic is then one reduction per step instead of one per
        call. The gradients are the same either way (up to the rounding of summing before or
        after averaging). Under ZeRO-3 every backward still reduce-scatters (its gradients
        are never kept whole). A pipelined ``model(batch)`` reduces once per call already,
        in its last micro-batch's backward.
        """
        return self.gradient_sync() if self.gradient_sync is not None else contextlib.nullcontext()

    def layer_modules(self) -> list[torch.nn.Module]:
        """The units ZeRO-3 gathers one at a time, in forward order: the model itself (for what
        lies outside its blocks: embeddings, final norm, head) and each block of this stage."""
        path = self.plan.blocks_path
        if not path:
            try:
                path = find_blocks(self.module)[0]
            except ValueError:  # no ModuleList: the whole model is one unit
                return [self.module]
        return [self.module, *self.module.get_submodule(path).children()]

    def named_parameters_with_meta(self) -> list[tuple[str, torch.nn.Parameter, ParameterMeta]]:
        """``(path, param, meta)`` for each unique local parameter, paths as in the unmodified model."""
        return [(n, p, get_parameter_meta(p)) for n, p in self.module.named_parameters()]


def _topology(plan: Plan, topology: Topology | None) -> Topology:
    if not (dist.is_available() and dist.is_initialized()) and plan.world_size > 1:
        raise ValueError(f"parallelize: the plan needs {plan.world_size} ranks; initialise torch.distributed first")
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world != plan.world_size:
        raise ValueError(
            f"parallelize: the plan needs world_size dp*tp*pp*cp={plan.world_size} but {world} ranks are running; "
            "regenerate the plan for this world size"
        )
    if topology is None:
        cfg = TopologyConfig(
            world_size=world,
            model_parallel_size=plan.model_parallel_size,
            pipe_parallel_size=plan.pipe_parallel_size,
            data_parallel_size=plan.data_parallel_size,
            data_parallel_shard_size=plan.data_parallel_shard_size,
            context_parallel_size=plan.context_parallel_size,
            # The running group's backend decides (NCCL: this rank's GPU; gloo: the CPU); with
            # none yet, CUDA where there is one, as torch's own default backend would.
            device=("cuda" if dist.get_backend() == "nccl" else "cpu") if dist.is_initialized() else "auto",
        )
        topology = Topology(cfg, dist.get_rank() if dist.is_initialized() else 0).initialize_distributed()
    sizes = (
        topology.axis("dp").size,
        topology.axis("tp").size,
        topology.axis("pp").size,
        topology.axis("cp").size,
    )
    planned = (plan.data_parallel_size, plan.model_parallel_size, plan.pipe_parallel_size, plan.context_parallel_size)
    if sizes != planned:
        raise ValueError(f"parallelize: topology (dp, tp, pp, cp)={sizes} differs from the plan's {planned}")
    return topology


def attach_metas(module: torch.nn.Module, plan: Plan, pipeline: PipelineStage | None = None) -> None:
    """Attach a :class:`ParameterMeta` keyed by the parameter path to every parameter.

    A parameter held by several pipeline stages (a tied LM head) gets its path as
    ``tied_key``: the gradient norm counts it once and ZeRO keeps its gradient for the
    sum over stages.
    """
    tied = {} if pipeline is None else {id(module.get_parameter(path)): path for path in pipeline.tied.keys()}
    for path, sub in module.named_modules():
        sharding = plan.module_sharding.get(path)
        for name, p in sub.named_parameters(recurse=False):
            full = f"{path}.{name}" if path else name
            if hasattr(p, "parameter_meta"):  # tied: keep the first path's identity
                continue
            dim = None if sharding is None else shard_dim(sharding, name)
            tp = plan.model_parallel_size if dim is not None else 1
            shape = list(p.shape)
            if dim is not None:
                shape[dim] *= tp
            ParameterMeta(full, tuple(shape), dim, tp, tied_key=tied.get(id(p))).attach(p)


S = TypeVar("S")  # what lr_scheduler_fn returns


def parallelize(
    plan: Plan,
    model: torch.nn.Module,
    optimizer_fn: Callable[[torch.nn.Module], torch.optim.Optimizer],
    lr_scheduler_fn: Callable[[torch.optim.Optimizer], S] | None,
    dataset: Dataset | None,
    *,
    collate_fn: Callable[..., object] | None = None,
    topology: Topology | None = None,
    compile: CompileConfig | bool = False,
    float8: Float8Config | bool = False,
) -> tuple[ParallelModel, ParallelOptimizer, S | None, DataLoader | None]:
    """Make ``model`` nD-parallel per ``plan``; the returned objects run the plain loop.

    Keeps only this rank's pipeline stage, materialises a deferred model shard by shard
    (values equal to the slices of a one-process :func:`materialize` under ``plan.seed``),
    replaces planned modules by TP shards, casts to ``plan.precision``, builds the
    optimizer on the local parameters, wraps it so ``step()`` reduces gradients (tied
    weights over stages, DP; ZeRO and fp32 master weights through ``scaling.optim`` when
    the plan asks), and shards ``dataset`` over DP (each DP rank gets
    ``global_batch_size / dp`` samples per step, in order; every stage of a pipeline reads
    the same samples).

    Args:
        plan: from :func:`generate_plan`.
        model: from :func:`deferred_init` (or an already materialised, unsharded model).
        optimizer_fn: ``model -> torch.optim.Optimizer`` over ``model.parameters()``.
        lr_scheduler_fn: ``optimizer -> scheduler`` (or ``None``).
        dataset: a map-style dataset (or ``None``: no loader).
        collate_fn: the loader's ``collate_fn``.
        topology: an initialised topology (default: built from the plan's sizes on the
            running default process group).
        compile: compile each block of this stage with ``torch.compile`` (a
            :class:`~scaling.nn.CompileConfig`, or True for its defaults), as torchtitan
            compiles each transformer block; the whole model when it has no blocks.
        float8: multiply the TP linears (the planned ``column``/``row`` modules, at every TP
            size) in float8 (a :class:`~scaling.nn.Float8Config`, or True for its defaults);
            the LM head, embeddings, layers matching ``exclude`` and layers smaller than
            ``min_features`` stay in ``plan.precision``. The chosen layers' names are in
            ``model.float8_layers``.

    Returns:
        ``(model, optimizer, scheduler, data_loader)``.

    Raises:
        ValueError: the world size differs from the plan, an optimizer ``scaling.optim``
            cannot run (ZeRO / reduced precision / offload need AdamW, Adam or SGD), or float8
            cannot run here or a chosen layer's local sizes are not multiples of 16 (named,
            with its shape and the fix).
    """
    topology = _topology(plan, topology)
    pipeline = None
    if plan.pipe_parallel_size > 1:
        if not plan.split_points:
            raise ValueError("parallelize: the plan has pipe_parallel_size > 1 but no split_points; use generate_plan")
        pipeline = PipelineStage(model, plan, topology)  # drops other stages' modules before materialising
    tp_rank, tp = topology.axis("tp").rank, topology.axis("tp").size
    group = topology.axis("tp").group if tp > 1 else None
    shard_fn = make_shard_fn(model, plan.module_sharding, group, tp_rank, tp)
    if is_deferred(model):
        materialize(model, plan.seed, shard_fn)
    else:
        present = dict(model.named_modules())
        for path in (p for p in plan.module_sharding if p in present):  # other stages' modules are gone
            replacement = shard_fn(path, model.get_submodule(path))
            parent, _, name = path.rpartition(".")
            setattr(model.get_submodule(parent), name, replacement)
    # Onto this rank's device (cuda:LOCAL_RANK or the CPU) in the plan's precision, before the
    # optimizer sees the parameters (the same parameter objects: their metas stay).
    model.to(device=topology.device, dtype=precision_dtype(plan.precision) if plan.precision != "float32" else None)
    attach_metas(model, plan, pipeline)
    if plan.context_parallel_size > 1:
        enable_context_parallel(model)
    float8_config = float8 if isinstance(float8, Float8Config) else Float8Config(enabled=float8)
    float8_layers = enable_float8(model, float8_config, setting="float8")
    wrapped = ParallelModel(model, plan, topology, pipeline)
    wrapped.float8_layers = float8_layers
    wrapped.compile_config = compile if isinstance(compile, CompileConfig) else CompileConfig(enabled=compile)
    units = wrapped.layer_modules()
    compile_layers(units[1:] or units, wrapped.compile_config)
    optimizer = ParallelOptimizer(optimizer_fn(model), wrapped)
    scheduler = lr_scheduler_fn(optimizer.optimizer) if lr_scheduler_fn is not None else None
    loader = None
    if dataset is not None:
        sampler: DistributedSampler[object] = DistributedSampler(
            dataset, num_replicas=topology.axis("dp").size, rank=topology.axis("dp").rank, shuffle=False
        )
        per_rank = plan.global_batch_size // plan.data_parallel_size
        loader = DataLoader(
            dataset,
            batch_size=per_rank,
            sampler=sampler,
            collate_fn=collate_fn,
            drop_last=True,
            pin_memory=topology.device.type == "cuda",  # for model(batch)'s non-blocking copies
        )
    return wrapped, optimizer, scheduler, loader
