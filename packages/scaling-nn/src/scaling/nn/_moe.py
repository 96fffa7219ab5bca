"""Mixture of experts: router, load balancing, shared experts and expert-parallel token dispatch.

Shape legend: T tokens of this rank (``b * s``), h hidden, E experts, k experts per token,
f an expert's inner size (``f / tp`` on a TP rank).

**Routing.** ``logits = x @ W_r^T`` (``[T, E]``), scores by softmax or sigmoid, the top-k
experts per token; their scores, renormalised to sum to 1 when ``normalize_top_k`` (always
for sigmoid, as DeepSeek-V3 does) and times ``routed_scaling_factor``, weight the experts'
outputs. Group-limited routing (DeepSeek-V3's ``n_group`` / ``topk_group``): the experts form
``num_groups`` equal groups, each scored by the sum of its two best choice scores, and a
token picks its top-k among the experts of its ``top_groups`` best groups only (with expert
parallelism over groups, a token's pairs then reach at most ``top_groups`` ranks).

**Balancing.** ``"aux_loss"`` (Switch / Mixtral): ``E · Σ_e f_e · P_e`` with ``f_e`` the
share of the k·T routing slots that went to expert ``e`` and ``P_e`` its mean routing
probability, over the micro-batch's tokens (every context-parallel rank's slice of them):
what one process computes for the same micro-batch, so a data-parallel run sums the same
per-micro-batch losses. With ``global_aux_loss`` the statistics are those of the same micro-batch
on every DP × CP rank together (the global-batch balancing of Qiu et al. 2025 at the scope a
pipeline allows, Megatron's ``global_aux_loss``): the loss is that of one process whose
micro-batch is the ranks' micro-batches together (dp2 with one micro-batch of b sequences per rank
equals one process with one of 2b). Its gradient is injected in the backward (scaled by
``aux_loss_coefficient · aux_loss_scale``), so it needs no path to the model's loss and
works on any pipeline stage. ``"aux_loss_free"`` (DeepSeek-V3): a per-expert bias added
to the scores for the top-k choice only, moved once per optimizer step (``end_step``, which a
trainer calls after the step) by ``bias_update_rate`` towards the mean load
(``b_e += rate · sign(mean - load_e)``), the load being the step's: its micro-batches summed,
over every DP × CP rank, so that every replica keeps the same bias and every layout moves it
as one process does.
``"none"``: neither. ``sequence_aux_loss_coefficient > 0`` adds DeepSeek-V3's complementary
sequence-wise balance loss to any of them: the same ``E · Σ_e f_e · P_e`` with ``f_e`` and ``P_e``
taken over each sequence's tokens (every context-parallel rank's slice of it, summed there), the
mean over the micro-batch's sequences; DeepSeek-V3 weighs it 1e-4 beside the aux-loss-free bias.

**Dispatch (dropless).** The T·k (token, expert) pairs are sorted by expert; with expert
parallelism each rank holds ``E / ep`` experts and the pairs travel to their expert's rank
by one all-to-all of uneven splits over the expert-parallel group, are computed there, and
travel back the same way (``scaling.collectives.all_to_all_tokens``). No token is dropped:
there is no capacity factor.

**Expert compute.** On CUDA in bf16 a rank's experts run as three grouped matrix multiplies
over the pairs sorted by expert (``torch._grouped_mm``: one kernel per projection for all the
experts, CUTLASS on Hopper), with the experts' weights stacked for it, as torchtitan's grouped
experts and Megatron's grouped GEMM do (stacked in the forward and again in the backward, never
kept in between: ``_GroupedLinear``); the grouped path needs no host read of the expert
sizes (with one EP rank, none at all). Elsewhere a loop over the experts: on CPU torch's
grouped multiply is itself a loop of matrix multiplies, so stacking the weights only costs
(``grouped_gemm=True`` runs it there anyway, bitwise the loop: the tests do); in other
dtypes (torch's grouped kernel and its shape-only kernel, which compiled layers trace with,
take bf16 only), without ``torch._grouped_mm`` (torch < 2.8), with ``grouped_gemm=False`` or
sizes not a multiple of 8 (16-byte rows).

**Tensor parallelism inside each expert.** Every TP rank routes the same tokens; each
expert's gate/up projections are column-split and its down projection row-split, so the
outputs are partial sums reduced over TP once per layer (a reduce-scatter under sequence
parallelism), as in ``ParallelSwiGLUMLP``.

Expert parameters are named by their global index (``experts.{e}.gate.weight``): a rank
holds only its experts', and the names are the same at every EP size, so checkpoints
stay layout-independent. Their ``ParameterMeta.is_expert`` is True.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F

from scaling.collectives import (
    all_reduce,
    all_to_all_tokens,
    copy_to_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from scaling.nn._init import (
    InitMethod,
    axis_from,
    check_divisible,
    check_dtype,
    default_weight_init,
    sharded_parameter,
    tp_info,
)
from scaling.nn._meta import get_parameter_meta
from scaling.nn._mlp import ParallelSwiGLUMLP

if TYPE_CHECKING:
    from scaling.collectives import AutogradContext
    from scaling.topology import Axis, Topology

SCORE_FUNCTIONS = ("softmax", "sigmoid")
BALANCING = ("aux_loss", "aux_loss_free", "none")


def check_moe(
    num_experts: int,
    top_k: int,
    expert_parallel_size: int,
    score_function: str,
    balancing: str,
    num_groups: int = 1,
    top_groups: int = 1,
) -> None:
    """Refuse an MoE configuration that cannot run (before any process group starts).

    Raises:
        ValueError: naming the value and the choices.
    """
    if score_function not in SCORE_FUNCTIONS:
        raise ValueError(f"MoE: score_function={score_function!r}; choose one of {list(SCORE_FUNCTIONS)}")
    if balancing not in BALANCING:
        raise ValueError(f"MoE: balancing={balancing!r}; choose one of {list(BALANCING)}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"MoE: top_k={top_k} must be between 1 and num_experts={num_experts}")
    if num_experts % expert_parallel_size:
        choices = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
        raise ValueError(
            f"MoE: num_experts={num_experts} is not divisible by expert_parallel_size={expert_parallel_size}; "
            f"choose expert_parallel_size in {choices} (it must also divide data_parallel_size)"
        )
    if num_groups < 1 or num_experts % num_groups or (num_groups > 1 and num_experts // num_groups < 2):
        choices = [d for d in range(1, num_experts // 2 + 1) if num_experts % d == 0]
        raise ValueError(
            f"MoE: num_groups={num_groups} must divide num_experts={num_experts} into groups of at least 2 "
            f"experts (each group is scored by its two best); choose num_groups in {choices}"
        )
    if not 1 <= top_groups <= num_groups or top_k > top_groups * (num_experts // num_groups):
        raise ValueError(
            f"MoE: top_groups={top_groups} must be between 1 and num_groups={num_groups}, and its groups must hold "
            f"top_k={top_k} experts ({num_experts // num_groups} a group)"
        )


class _GroupedLinear(torch.autograd.Function):
    """``x W_e^T`` on each expert's rows of ``x`` (sorted by expert; ``offsets``: where each
    expert's rows end) as one grouped matrix multiply, its weights ``W_e`` ``[out, in]``.

    The weights are stacked for the kernel in the forward, and again in the backward, and
    only the expert parameters themselves are saved: through autograd, the grouped multiply
    would save the stacked copy, a second copy of every expert weight held from the forward
    to the backward (under ZeRO-3, gathered weights kept past their layer's forward). The
    gradients are the products torch's own grouped-multiply backward computes, in the same
    layouts (bitwise on CPU; the weights' arrive stacked ``[E, out, in]``, each a contiguous
    view).
    """

    @staticmethod
    def forward(ctx: AutogradContext, x: torch.Tensor, offsets: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, offsets, *weights)
        return torch._grouped_mm(x, torch.stack(weights).transpose(-2, -1), offs=offsets)

    @staticmethod
    def backward(ctx: AutogradContext, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, offsets, *weights = ctx.saved_tensors
        grad = grad.contiguous()  # CUDA's kernel takes row- or column-major operands only (not, say, expanded)
        grad_x = torch._grouped_mm(grad, torch.stack(weights), offs=offsets) if ctx.needs_input_grad[0] else None
        grad_w: tuple[torch.Tensor | None, ...] = (None,) * len(weights)
        if any(ctx.needs_input_grad[2:]):
            grad_w = torch._grouped_mm(grad.t(), x, offs=offsets).unbind(0)
        return grad_x, None, *grad_w


def _swiglu_experts(
    rows: torch.Tensor, counts: torch.Tensor, experts: list[torch.nn.ParameterDict], grouped: bool | None
) -> torch.Tensor:
    """Each expert's SwiGLU on its rows: ``rows`` ``[N, h]`` sorted by expert, ``counts[j]`` of
    them for ``experts[j]`` (a device tensor); ``[N, h]`` (TP-partial sums) in the same order."""
    h = rows.shape[-1]
    if not experts:
        return rows.new_zeros((0, h))
    f = experts[0]["gate"].shape[0]
    if grouped is None:  # where one kernel replaces the loop; on CPU torch's grouped multiply loops too
        grouped = rows.device.type == "cuda"
    # bf16: the grouped kernel's type (torch's shape-only kernel, which compiled layers trace
    # with, takes no other); rows start at 16-byte multiples (8 elements).
    if grouped and hasattr(torch, "_grouped_mm") and rows.dtype == torch.bfloat16 and h % 8 == 0 and f % 8 == 0:
        offsets = counts.cumsum(0).to(torch.int32)
        gate, up, down = ([w[name] for w in experts] for name in ("gate", "up", "down"))
        grouped_linear = _GroupedLinear.apply
        inner = F.silu(grouped_linear(rows, offsets, *gate)) * grouped_linear(rows, offsets, *up)
        return typing.cast(torch.Tensor, grouped_linear(inner, offsets, *down))
    chunks = rows.split(counts.tolist())
    outputs = [
        F.linear(F.silu(F.linear(c, w["gate"])) * F.linear(c, w["up"]), w["down"]) for c, w in zip(chunks, experts)
    ]
    return torch.cat(outputs)


class _InjectAuxLoss(torch.autograd.Function):
    """Identity on ``out``; in the backward, the auxiliary loss gets gradient ``scale``."""

    @staticmethod
    def forward(ctx: AutogradContext, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale, ctx.aux_shape = scale, aux.shape
        return out.view_as(out)

    @staticmethod
    def backward(ctx: AutogradContext, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        return grad, torch.full(ctx.aux_shape, ctx.scale, dtype=torch.float32, device=grad.device), None


@dataclass(frozen=True)
class MoEConfig:
    """What a :class:`ParallelMoE` computes, apart from the axes it runs over.

    Attributes:
        hidden_size: input and output size.
        ffn_size: inner size of each expert (divisible by the TP size).
        num_experts: experts ``E`` (divisible by the EP size).
        top_k: experts per token.
        score_function: ``"softmax"`` or ``"sigmoid"``.
        normalize_top_k: renormalise the top-k scores to sum to 1 (softmax; sigmoid always does).
        routed_scaling_factor: multiplies the top-k weights (DeepSeek-V3: 2.5).
        num_groups, top_groups: group-limited routing (module docstring); 1, 1: none.
        num_shared_experts: experts every token goes through (one SwiGLU of
            ``num_shared_experts * ffn_size``), added to the routed output.
        balancing: ``"aux_loss"``, ``"aux_loss_free"`` or ``"none"`` (module docstring).
        aux_loss_coefficient: weight of the auxiliary loss (``balancing="aux_loss"``).
        sequence_aux_loss_coefficient: weight of DeepSeek-V3's complementary sequence-wise
            balance loss (module docstring), with any balancing; 0: none.
        global_aux_loss: the auxiliary loss's ``f`` and ``P`` over the micro-batch of every DP × CP
            rank together (module docstring).
        bias_update_rate: step of the aux-loss-free bias.
        sequence_parallel: input and output split along dim 1 over TP.
        grouped_gemm: in bf16, the experts as grouped matrix multiplies (module docstring):
            None = on CUDA, True = wherever torch has them, False = a loop over the experts.
        dtype: parameter dtype.
        init_method, output_init_method: initialisers of the up and down projections.

    Example::

        MoEConfig(hidden_size=512, ffn_size=1024, num_experts=8, top_k=2, balancing="aux_loss_free")
    """

    hidden_size: int
    ffn_size: int
    num_experts: int
    top_k: int = 2
    score_function: str = "softmax"
    normalize_top_k: bool = True
    routed_scaling_factor: float = 1.0
    num_groups: int = 1
    top_groups: int = 1
    num_shared_experts: int = 0
    balancing: str = "aux_loss"
    aux_loss_coefficient: float = 1e-2
    sequence_aux_loss_coefficient: float = 0.0
    global_aux_loss: bool = False
    bias_update_rate: float = 1e-3
    sequence_parallel: bool = False
    grouped_gemm: bool | None = None
    dtype: torch.dtype = torch.float32
    init_method: InitMethod | None = None
    output_init_method: InitMethod | None = None


class ParallelMoE(torch.nn.Module):
    """A mixture-of-experts SwiGLU feed-forward block, expert- and tensor-parallel.

    Args:
        config: what it computes (:class:`MoEConfig`).
        tp: the tensor-parallel axis each expert is split over (``topology.axis("tp")``).
        ep: the expert-parallel axis its experts are spread over (``topology.axis("ep")``).
        cp: the context-parallel axis; the load statistics sum over it.
        dp_cp: the data × context-parallel axis the aux-loss-free load is summed over.
        device: where its parameters live (default: CPU without ``tp``, torch's default
            device with it).
        topology: instead of the axes and ``device``: a :class:`scaling.topology.Topology`
            they are taken from at once. An axis left out (None) has one rank.

    After each forward ``last_aux_loss`` (the unweighted auxiliary loss of the micro-batch,
    detached) and ``last_load`` (``[E]`` routing slots each expert got in it) hold what a
    trainer logs; ``load_total`` and ``aux_loss_total`` sum them over the micro-batches until a
    trainer sets them to None (per step); :meth:`end_step` moves the aux-loss-free bias by
    ``load_total``.
    ``aux_loss_scale`` multiplies the injected gradient (a trainer sets it to its loss scale
    over its micro-batch count, as the main loss is scaled).

    Example::

        moe = ParallelMoE(MoEConfig(512, 1024, num_experts=8), topology=topology)
    """

    def __init__(
        self,
        config: MoEConfig,
        *,
        tp: Axis | None = None,
        ep: Axis | None = None,
        cp: Axis | None = None,
        dp_cp: Axis | None = None,
        device: torch.device | str | None = None,
        topology: Topology | None = None,
    ) -> None:
        super().__init__()
        c = self.config = config
        check_dtype(c.dtype, "ParallelMoE")
        tp_ = self._tp = tp_info(topology, tp, device, "ParallelMoE")
        axes = {name: axis_from(topology, name, given, "ParallelMoE") for name, given in
                (("tp", tp), ("ep", ep), ("cp", cp), ("dp_cp", dp_cp))}  # fmt: skip
        self.grouped_gemm = c.grouped_gemm
        ep_axis = axes["ep"]
        ep_size = 1 if ep_axis is None else ep_axis.size
        check_moe(c.num_experts, c.top_k, ep_size, c.score_function, c.balancing, c.num_groups, c.top_groups)
        check_divisible("ffn_size", c.ffn_size, tp_.size, "ParallelMoE")
        hidden_size, ffn_size, num_experts = c.hidden_size, c.ffn_size, c.num_experts
        self.hidden_size, self.num_experts, self.top_k = hidden_size, num_experts, c.top_k
        self.score_function = c.score_function
        self.normalize_top_k = c.normalize_top_k or c.score_function == "sigmoid"
        self.balancing, self.aux_loss_coefficient, self.bias_update_rate = (
            c.balancing,
            c.aux_loss_coefficient,
            c.bias_update_rate,
        )
        self.sequence_aux_loss_coefficient = c.sequence_aux_loss_coefficient
        self.global_aux_loss = c.global_aux_loss
        self.sequence_parallel = c.sequence_parallel
        self.aux_loss_scale = 1.0
        self._ep_group = None if ep_axis is None else ep_axis.group
        self._ep_size, self._ep_rank = ep_size, (0 if ep_axis is None else ep_axis.rank)
        self._cp_group = None if axes["cp"] is None else axes["cp"].group
        self._dp_group = None if axes["dp_cp"] is None else axes["dp_cp"].group
        self.num_local_experts = num_experts // ep_size
        init = c.init_method or default_weight_init
        out_init = c.output_init_method or c.init_method or default_weight_init
        dtype = c.dtype
        # The router sees every token on every TP rank; under SP each rank routes its slice.
        self.router = sharded_parameter(
            (num_experts, hidden_size), init, tp_, None, dtype, "router", c.sequence_parallel
        )
        # A frozen parameter, not a buffer: checkpoints save parameters (aux-loss-free balancing moves it).
        self.expert_bias = sharded_parameter((num_experts,), None, tp_, None, torch.float32, "expert_bias")
        self.expert_bias.requires_grad_(False)
        first = self._ep_rank * self.num_local_experts
        experts = {}
        for e in range(num_experts):  # every expert is drawn on every rank: the same values at every EP size
            weights = {
                "gate": sharded_parameter((ffn_size, hidden_size), init, tp_, 0, dtype, f"experts.{e}.gate"),
                "up": sharded_parameter((ffn_size, hidden_size), init, tp_, 0, dtype, f"experts.{e}.up"),
                "down": sharded_parameter((hidden_size, ffn_size), out_init, tp_, 1, dtype, f"experts.{e}.down"),
            }
            if first <= e < first + self.num_local_experts:
                expert = torch.nn.ParameterDict(weights)
                for p in expert.values():
                    get_parameter_meta(p).with_expert().attach(p)
                experts[str(e)] = expert
        self.experts = torch.nn.ModuleDict(experts)
        self.shared = (
            ParallelSwiGLUMLP(
                hidden_size,
                c.num_shared_experts * ffn_size,
                bias=False,
                dtype=dtype,
                sequence_parallel=c.sequence_parallel,
                init_method=c.init_method,
                output_init_method=c.output_init_method,
                tp=axes["tp"],
                device=tp_.device,
            )
            if c.num_shared_experts
            else None
        )
        self.last_aux_loss: torch.Tensor | None = None
        #: The last micro-batch's unweighted sequence-wise loss (``sequence_aux_loss_coefficient > 0``).
        self.last_sequence_aux_loss: torch.Tensor | None = None
        self.last_load: torch.Tensor | None = None
        self.load_total: torch.Tensor | None = None
        self.aux_loss_total: torch.Tensor | None = None

    # ----------------------------------------------------------------- routing
    def _route(self, x_bsh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(probs [T, E], top-k experts [T, k], their weights [T, k])`` for every token of the TP group."""
        logits = F.linear(x_bsh, self.router).float()
        if self.sequence_parallel:  # every TP rank routes every token; the gradient keeps its own slice
            logits = gather_from_sequence_parallel_region(logits, self._tp.group, tensor_parallel_output_grad=False)
        logits = logits.reshape(-1, self.num_experts)
        scores = logits.softmax(-1) if self.score_function == "softmax" else logits.sigmoid()
        choice = scores.detach() + self.expert_bias if self.balancing == "aux_loss_free" else scores.detach()
        groups = self.config.num_groups
        if groups > 1:  # each group scored by its two best experts; only the top_groups best stay choosable
            group_scores = choice.view(-1, groups, self.num_experts // groups).topk(2, dim=-1).values.sum(-1)
            best = group_scores.topk(self.config.top_groups, dim=-1).indices
            kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
            choice = choice.masked_fill(~kept.repeat_interleave(self.num_experts // groups, dim=1), float("-inf"))
        top = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, top)
        if self.normalize_top_k:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights * self.config.routed_scaling_factor
        probs = scores if self.score_function == "softmax" else scores / scores.sum(-1, keepdim=True)
        return probs, top, weights

    def _balance(self, probs: torch.Tensor, top: torch.Tensor) -> torch.Tensor | None:
        """Load statistics of the micro-batch (every CP rank's tokens); this rank's aux loss share (or None).

        ``global_aux_loss``: while training, the loss's statistics are those of the same micro-batch on
        every DP × CP rank (the load logged and the aux-loss-free bias's stay this micro-batch's own)."""
        counts = torch.bincount(top.flatten(), minlength=self.num_experts).to(torch.float32)
        local = torch.cat([counts, probs.detach().sum(0), probs.new_tensor([probs.shape[0]])])
        stats = all_reduce(local.clone(), self._cp_group)
        load = stats[: self.num_experts]
        injects = self.balancing == "aux_loss" and self.training and torch.is_grad_enabled()
        # Only while training: evaluation and generation may run on some DP ranks alone.
        loss_group = self._dp_group if self.global_aux_loss and injects else self._cp_group
        if loss_group is not self._cp_group:
            stats = all_reduce(local, loss_group)
        share, prob_sums, tokens = (
            stats[: self.num_experts] / (stats[-1] * self.top_k),
            stats[self.num_experts : -1],
            stats[-1],
        )
        if torch._C._current_graph_task_id() == -1:  # a recomputation in the backward counted them already
            self.last_load = load
            self.load_total = load if self.load_total is None else self.load_total + load
            aux = self.last_aux_loss = self.num_experts * (share * prob_sums / tokens).sum()
            self.aux_loss_total = aux if self.aux_loss_total is None else self.aux_loss_total + aux
        if not injects:
            return None
        # This rank's tokens' part of E·Σ f_e P_e (to inject), times the ranks its gradient is averaged over.
        ranks = 1 if loss_group is None else dist.get_world_size(loss_group)
        return self.aux_loss_coefficient * self.num_experts * ranks * (share * probs.sum(0) / tokens).sum()

    @torch.no_grad()
    def end_step(self) -> None:
        """After an optimizer step, with ``"aux_loss_free"`` balancing: move the bias by the step's load
        (``load_total``: its micro-batches, summed over every DP × CP rank), as DeepSeek-V3 does once per
        step; every replica moves it alike. Else, or with no load counted since it was reset, nothing.

        A trainer calls it on every rank of the layer's stage, with the bias whole (under ZeRO-3
        inside ``optimizer.data_parallel.whole([layer.expert_bias])``), before a checkpoint is taken.
        """
        if self.balancing != "aux_loss_free" or self.load_total is None:
            return
        total = all_reduce(self.load_total.clone(), self._dp_group)
        self.expert_bias.add_(self.bias_update_rate * torch.sign(total.mean() - total))

    def _sequence_aux_share(self, probs: torch.Tensor, top: torch.Tensor, batch: int) -> torch.Tensor:
        """This rank's tokens' part of the weighted sequence-wise loss: ``E · Σ_e f_e P_e`` per sequence
        over its tokens on every CP rank, the mean over the ``batch`` sequences (the rows of ``probs``
        and ``top`` are ``batch`` sequences of equal length, sequence-major), times the CP ranks."""
        experts = self.num_experts
        by_sequence = top.view(batch, -1)
        counts = torch.zeros(batch, experts, device=top.device).scatter_add_(
            1, by_sequence, torch.ones_like(by_sequence, dtype=torch.float32)
        )
        local = probs.view(batch, -1, experts)
        stats = torch.cat([counts, local.detach().sum(1), local.new_full((batch, 1), float(local.shape[1]))], dim=1)
        all_reduce(stats, self._cp_group)
        share, prob_sums, tokens = (
            stats[:, :experts] / (stats[:, -1:] * self.top_k),
            stats[:, experts:-1],
            stats[:, -1:],
        )
        if torch._C._current_graph_task_id() == -1:  # not a recomputation in the backward
            self.last_sequence_aux_loss = (experts * (share * prob_sums / tokens).sum(1)).mean()
        ranks = 1 if self._cp_group is None else dist.get_world_size(self._cp_group)
        weighted = (share * local.sum(1) / tokens).sum(1).mean()
        return self.sequence_aux_loss_coefficient * experts * ranks * weighted

    # ---------------------------------------------------------------- dispatch
    def _experts(self, x_th: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
        """Each (token, expert) pair's expert output, ``[T * k, h]`` in ``top.flatten()`` order (TP-partial)."""
        flat = top.flatten()
        order = torch.argsort(flat, stable=True)
        routed = x_th.index_select(0, order // self.top_k)
        counts = torch.bincount(flat, minlength=self.num_experts)
        local = self.num_local_experts
        if self._ep_size > 1:
            recv_counts = all_to_all_tokens(counts, [local] * self._ep_size, [local] * self._ep_size, self._ep_group)
            send_splits = counts.view(self._ep_size, local).sum(1).tolist()
            recv_splits = recv_counts.view(self._ep_size, local).sum(1).tolist()
            routed = all_to_all_tokens(routed, recv_splits, send_splits, self._ep_group)
            per_src = recv_counts.view(self._ep_size, local)
            # Rows arrive grouped by source rank, each by expert: regroup by expert.
            src = torch.repeat_interleave(
                torch.arange(self._ep_size * local, device=flat.device) % local, per_src.flatten()
            )
            by_expert = torch.argsort(src, stable=True)
            rows = routed.index_select(0, by_expert)
            local_counts = per_src.sum(0)
        else:
            by_expert, rows, local_counts = None, routed, counts
        first = self._ep_rank * local
        experts = [self.experts[str(first + j)] for j in range(local)]
        out = _swiglu_experts(rows, local_counts, typing.cast(list[torch.nn.ParameterDict], experts), self.grouped_gemm)
        if by_expert is not None:
            out = out.index_select(0, torch.argsort(by_expert))
            out = all_to_all_tokens(out, send_splits, recv_splits, self._ep_group)
        return out.index_select(0, torch.argsort(order))

    def forward(self, x_bsh: torch.Tensor) -> torch.Tensor:
        """``[b, s, h]`` (``[b, s / tp, h]`` under sequence parallelism) in and out."""
        group = self._tp.group
        probs, top, weights = self._route(x_bsh)
        aux = self._balance(probs, top)
        if self.sequence_aux_loss_coefficient > 0 and self.training and torch.is_grad_enabled():
            sequences = self._sequence_aux_share(probs, top, x_bsh.shape[0])
            aux = sequences if aux is None else aux + sequences
        x_full = (
            gather_from_sequence_parallel_region(x_bsh, group)
            if self.sequence_parallel
            else copy_to_model_parallel_region(x_bsh, group)
        )
        b, s, h = x_full.shape
        pairs = self._experts(x_full.reshape(-1, h), top)  # [T * k, h], partial sums over TP
        # The pairs are TP-partial, so each rank's gradient of the weights is too: sum it over TP.
        weights = copy_to_model_parallel_region(weights, group)
        routed = (pairs.view(-1, self.top_k, h) * weights.unsqueeze(-1).to(pairs.dtype)).sum(1).view(b, s, h)
        out = (
            reduce_scatter_to_sequence_parallel_region(routed, group)
            if self.sequence_parallel
            else reduce_from_model_parallel_region(routed, group)
        )
        if self.shared is not None:
            out = out + self.shared(x_bsh)
        if aux is not None:
            out = _InjectAuxLoss.apply(out, aux, self.aux_loss_scale)
        return out
