"""ParallelMoE: against a per-token reference in one process, and expert/tensor parallel against one process.

"Within 1e-6 relative" as in nn_parity. Expert parallelism is checked the way a trainer
uses it: every DP rank has its own micro-batch, the loss is the mean over DP ranks of each
rank's loss plus each micro-batch's balancing loss; one process runs the same micro-batches
one after the other. Dense gradients are averaged over DP and each expert's gradient is
summed over the ranks holding that expert and divided by the DP size.
"""

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from scaling.nn import MoEConfig, ParallelMoE, check_moe
from scaling.testing import make_topology, run_distributed

sys.path.insert(0, os.path.dirname(__file__))
from nn_parity import close, full_tensor  # noqa: E402

H, FFN, E = 16, 32, 4


def _reference_output(moe, x):
    """Per token: its top-k experts' SwiGLU outputs weighted by the (renormalised) scores."""
    tokens = x.reshape(-1, H)
    logits = tokens @ moe.router.T
    scores = logits.softmax(-1) if moe.score_function == "softmax" else logits.sigmoid()
    out = []
    for t in range(tokens.shape[0]):
        choice = scores[t].detach() + (moe.expert_bias if moe.balancing == "aux_loss_free" else 0)
        top = choice.topk(moe.top_k).indices
        w = scores[t, top]
        if moe.normalize_top_k:
            w = w / w.sum()
        acc = torch.zeros(H)
        for weight, e in zip(w, top.tolist()):
            p = moe.experts[str(e)]
            acc = acc + weight * F.linear(
                F.silu(F.linear(tokens[t], p["gate"])) * F.linear(tokens[t], p["up"]), p["down"]
            )
        out.append(acc)
    return torch.stack(out).view_as(x)


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
@pytest.mark.parametrize("shared", [0, 1])
def test_matches_a_per_token_reference(score_function, shared):
    torch.manual_seed(0)
    moe = ParallelMoE(MoEConfig(H, FFN, E, top_k=2, score_function=score_function, num_shared_experts=shared))
    x = torch.randn(2, 5, H)
    y = moe(x)
    expected = _reference_output(moe, x) + (moe.shared(x) if shared else 0)
    close(y, expected, "moe output", rtol=1e-5)
    load = moe.last_load
    assert load.sum() == 2 * 5 * 2 and moe.last_aux_loss > 0


def _deepseek_v3(num_groups, top_groups):
    """transformers' DeepseekV3MoE (8 experts in 4 groups, 2 of them kept, top-2, scaling 2.5, a shared
    expert, a correction bias) with random weights, and ours with its weights."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    config = transformers.DeepseekV3Config(hidden_size=H, moe_intermediate_size=FFN, n_routed_experts=8,
                                           num_experts_per_tok=2, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                           n_shared_experts=1, norm_topk_prob=True)  # fmt: skip
    torch.manual_seed(0)
    hf = DeepseekV3MoE(config)
    with torch.no_grad():
        for p in [*hf.parameters(), *hf.buffers()]:
            p.normal_(0, 0.3)
    ours = ParallelMoE(MoEConfig(H, FFN, 8, top_k=2, score_function="sigmoid", balancing="aux_loss_free",
                                 num_shared_experts=1, num_groups=num_groups, top_groups=top_groups,
                                 routed_scaling_factor=2.5))  # fmt: skip
    with torch.no_grad():
        ours.router.copy_(hf.gate.weight)
        ours.expert_bias.copy_(hf.gate.e_score_correction_bias)
        for e in range(8):
            gate, up = hf.experts.gate_up_proj[e].chunk(2)
            for name, w in (("gate", gate), ("up", up), ("down", hf.experts.down_proj[e])):
                ours.experts[str(e)][name].copy_(w)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(ours.shared, name).weight.copy_(getattr(hf.shared_experts, name).weight)
    return hf, ours


def test_deepseek_v3_routing_matches_transformers():
    """Sigmoid scores with the correction bias, group-limited top-k, renormalised and scaled, plus the
    shared expert: transformers' DeepseekV3MoE output (fp32, 1e-5); without the group limit it differs."""
    hf, ours = _deepseek_v3(4, 2)
    x = torch.randn(2, 7, H, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(x)
        close(ours(x), expected, "DeepSeek-V3 MoE output", rtol=1e-5)
        _, ungrouped = _deepseek_v3(1, 1)
        assert not torch.allclose(ungrouped(x), expected, atol=1e-3)


def test_group_limited_routing_picks_within_the_best_groups():
    torch.manual_seed(0)
    moe = ParallelMoE(MoEConfig(H, FFN, 8, top_k=2, num_groups=4, top_groups=1))
    _, top, _ = moe._route(torch.randn(3, 5, H))
    assert (top // 2 == top[:, :1] // 2).all()  # both experts of a token in one group of 2


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason=f"torch {torch.__version__} has no _grouped_mm")
@pytest.mark.parametrize(("dtype", "grouped_calls"), [(torch.bfloat16, 12), (torch.float32, 0)])
def test_grouped_experts_equal_the_per_expert_loop_bitwise(monkeypatch, dtype, grouped_calls):
    """In bf16 the experts as three grouped matrix multiplies (what CUDA runs as one kernel
    each; forced here, on CPU, where the default loops) give the loop's outputs and gradients
    bit for bit, idle experts included; fp32 keeps the loop (torch's grouped kernels take
    bf16 only). Grouped: 3 calls per forward (two forwards) and 2 per projection in the backward."""
    calls = []
    grouped_mm = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or grouped_mm(*a, **k))
    runs = []
    for grouped in (True, False):
        torch.manual_seed(0)
        moe = ParallelMoE(
            MoEConfig(H, FFN, 16, top_k=2, dtype=dtype, grouped_gemm=grouped)
        )  # 16 experts, 12 slots: idle ones
        x = torch.randn(2, 3, H, dtype=dtype, generator=torch.Generator().manual_seed(1), requires_grad=True)
        moe(x).backward(torch.randn(2, 3, H, dtype=dtype, generator=torch.Generator().manual_seed(2)))
        runs.append([moe(x).detach(), x.grad, *(p.grad for p in moe.parameters() if p.grad is not None)])
        assert (moe.last_load == 0).any()
    assert len(calls) == grouped_calls  # none in the loop's run
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason=f"torch {torch.__version__} has no _grouped_mm")
def test_grouped_experts_keep_no_stacked_copy_of_the_weights_for_the_backward():
    """What autograd saves between the forward and the backward of the grouped experts: the
    expert parameters themselves, never a stacked copy of them (which, for a large MoE layer,
    is a second copy of all its expert weights, and under ZeRO-3 would outlive the layer)."""
    torch.manual_seed(0)
    moe = ParallelMoE(MoEConfig(H, FFN, 16, top_k=2, dtype=torch.bfloat16, grouped_gemm=True))
    params = {p.data_ptr() for p in moe.parameters()}
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.data_ptr()))
        return t

    x = torch.randn(2, 3, H, dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = moe(x)
    assert not [shape for shape, _ in saved if len(shape) == 3 and shape[0] == 16], saved  # no [experts, ., .]
    assert sum(ptr in params for _, ptr in saved) >= 3 * 16  # each expert's three weights, as they are
    y.sum().backward()
    assert all(moe.experts[str(e)]["gate"].grad is not None for e in range(16))


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason=f"torch {torch.__version__} has no _grouped_mm")
@pytest.mark.parametrize(("h", "f"), [(64, 96), (2048, 1408), (8, 16)])
def test_grouped_experts_calls_trace_on_the_meta_device(h, f):
    """The grouped calls of the forward and the backward, as CUDA gets them: torch's meta kernel for
    ``_grouped_mm`` runs the CUDA kernel's checks (bf16, row- or column-major operands with rows
    aligned to 16 bytes), so every layout the backward passes (the gradient transposed, the stacked
    weights as they are) is checked here without a GPU; the shapes come out as the weights'."""
    from scaling.nn._moe import _GroupedLinear

    rows = torch.empty(40, h, dtype=torch.bfloat16, device="meta", requires_grad=True)
    offsets = torch.empty(4, dtype=torch.int32, device="meta")
    weights = [torch.empty(f, h, dtype=torch.bfloat16, device="meta", requires_grad=True) for _ in range(4)]
    out = _GroupedLinear.apply(rows, offsets, *weights)
    out.backward(torch.empty_like(out))
    assert out.shape == (40, f) and rows.grad.shape == (40, h)
    assert all(w.grad.shape == (f, h) and w.grad.is_contiguous() for w in weights)


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason=f"torch {torch.__version__} has no _grouped_mm")
def test_compiled_grouped_experts_equal_eager():
    """The grouped experts' autograd function compiles (aot_eager: Dynamo's capture and AOTAutograd's
    forward/backward split of it): outputs and every gradient bit for bit as eager."""
    import torch._dynamo

    torch._dynamo.reset()
    torch.manual_seed(0)
    moe = ParallelMoE(MoEConfig(H, FFN, 8, top_k=2, dtype=torch.bfloat16, grouped_gemm=True))
    x = torch.randn(2, 8, H, dtype=torch.bfloat16, requires_grad=True)
    runs = []
    for forward in (moe.forward, torch.compile(moe.forward, backend="aot_eager")):
        x.grad = None
        moe.zero_grad()
        y = forward(x)
        y.float().pow(2).sum().backward()
        runs.append([y.detach(), x.grad, *(p.grad for p in moe.parameters() if p.grad is not None)])
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def test_aux_loss_gradient_is_injected():
    """With a main loss of zero gradient the router gets exactly d(coefficient · aux)/dW."""
    torch.manual_seed(0)
    moe = ParallelMoE(MoEConfig(H, FFN, E, top_k=2, aux_loss_coefficient=0.5))
    x = torch.randn(3, 4, H)
    (moe(x) * 0).sum().backward()
    # The aux loss by hand: E · Σ_e f_e · P_e, f from the (non-differentiable) top-k counts.
    router = moe.router.detach().requires_grad_()
    probs = (x.reshape(-1, H) @ router.T).softmax(-1)
    f = torch.bincount(probs.topk(2).indices.flatten(), minlength=E) / (12 * 2)
    aux = E * (f * probs.mean(0)).sum()
    (aux * 0.5).backward()
    close(moe.last_aux_loss, aux, "aux loss")
    close(moe.router.grad, router.grad, "injected aux gradient")
    moe.eval()  # no injection outside training
    moe.zero_grad()
    (moe(x) * 0).sum().backward()
    assert not moe.router.grad.any()


@pytest.mark.parametrize("balancing", ["aux_loss", "aux_loss_free"])
def test_sequence_wise_loss_gradient_is_injected(balancing):
    """DeepSeek-V3's complementary sequence-wise loss by hand: E · Σ_e f_e · P_e over each sequence's
    tokens, the mean over the sequences, weighted by its coefficient (beside the Switch loss, or
    with the aux-loss-free bias, which then picks the experts)."""
    torch.manual_seed(0)
    config = MoEConfig(H, FFN, E, top_k=2, aux_loss_coefficient=0.5, sequence_aux_loss_coefficient=0.25,
                       balancing=balancing, score_function="sigmoid")  # fmt: skip
    moe = ParallelMoE(config)
    with torch.no_grad():
        moe.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.1, 0.0]))
    x = torch.randn(3, 4, H)
    (moe(x) * 0).sum().backward()
    router = moe.router.detach().requires_grad_()
    scores = (x.reshape(-1, H) @ router.T).sigmoid()
    probs = scores / scores.sum(-1, keepdim=True)
    choice = scores.detach() + (moe.expert_bias if balancing == "aux_loss_free" else 0)
    top = choice.topk(2).indices
    total = 0.0
    if balancing == "aux_loss":
        total = 0.5 * E * (torch.bincount(top.flatten(), minlength=E) / (12 * 2) * probs.mean(0)).sum()
    per_sequence = []
    for b in range(3):
        f = torch.bincount(top.view(3, 8)[b], minlength=E) / (4 * 2)
        per_sequence.append(E * (f * probs.view(3, 4, E)[b].mean(0)).sum())
    sequence_loss = torch.stack(per_sequence).mean()
    (total + 0.25 * sequence_loss).backward()
    close(moe.last_sequence_aux_loss, sequence_loss, "sequence-wise loss")
    close(moe.router.grad, router.grad, "injected gradient")


def test_aux_loss_free_bias_moves_once_per_step_by_the_step_s_load():
    torch.manual_seed(0)
    moe = ParallelMoE(MoEConfig(H, FFN, E, top_k=1, balancing="aux_loss_free", bias_update_rate=0.1))
    x = torch.randn(4, 8, H)
    moe(x)
    moe(x[:2])  # a second micro-batch of the step: the bias stays within a step
    assert not moe.expert_bias.any()
    load = moe.load_total
    moe.end_step()
    assert torch.equal(moe.expert_bias, 0.1 * torch.sign(load.mean() - load))
    moe.load_total = None  # the trainer's reset at the next step
    moe.end_step()  # nothing counted: no move
    assert torch.equal(moe.expert_bias, 0.1 * torch.sign(load.mean() - load))
    close(moe(x), _reference_output(moe, x), "biased routing", rtol=1e-5)  # the bias picks, the scores weigh


def _ep_parity(dp, tp, ep, sequence_parallel, dtype=torch.float32, routing=None):
    topo = make_topology(model_parallel_size=tp, data_parallel_size=dp, expert_parallel_size=ep)
    d, t = topo.axis("dp").rank, topo.axis("tp").rank
    # bf16: the experts as grouped matrix multiplies (forced on CPU, where the default loops).
    kwargs = dict(top_k=2, num_shared_experts=1, aux_loss_coefficient=0.1, dtype=dtype, grouped_gemm=True)
    kwargs.update(routing or {})
    rtol = 1e-6 if dtype == torch.float32 else 2e-2
    torch.manual_seed(0)
    moe = ParallelMoE(MoEConfig(H, FFN, E, sequence_parallel=sequence_parallel, **kwargs), topology=topo)
    torch.manual_seed(0)
    ref = ParallelMoE(MoEConfig(H, FFN, E, **kwargs))
    g = torch.Generator().manual_seed(1)
    x_all, grad_all = (torch.randn(dp, 2, 8, H, generator=g).to(dtype) for _ in range(2))
    # One process runs the DP ranks' batches as micro-batches: each loss (and each
    # micro-batch's balancing loss) weighs 1 / dp, as the DP mean does.
    x_ref = x_all.clone().requires_grad_()
    outputs, aux, loads = [], [], []
    if kwargs.get("global_aux_loss"):  # one micro-batch of every rank's sequences: the loss the DP ranks share
        y_ref = ref(x_ref.flatten(0, 1)).view_as(x_ref)
        (y_ref * grad_all).sum().div(dp).backward()
        aux = [ref.last_aux_loss] * dp
        with torch.no_grad():  # each rank's own load (what it logs): its micro-batch alone
            for r in range(dp):
                ref(x_all[r])
                loads.append(ref.last_load)
    else:
        ref.aux_loss_scale = 1.0 / dp
        for r in range(dp):
            outputs.append(ref(x_ref[r]))
            (outputs[-1] * grad_all[r]).sum().div(dp).backward()
            aux.append(ref.last_aux_loss)
            loads.append(ref.last_load)
        y_ref = torch.stack(outputs)

    def mine(full):  # this rank's tokens (its sequence-parallel slice)
        return full[d].chunk(tp, dim=1)[t] if sequence_parallel else full[d]

    x = mine(x_all).clone().requires_grad_()
    y = moe(x)
    (y * mine(grad_all)).sum().backward()
    close(y, mine(y_ref.detach()), "output", rtol)
    close(x.grad / dp, mine(x_ref.grad), "input gradient", rtol)
    close(moe.last_aux_loss, aux[d], "aux loss", rtol)
    assert torch.equal(moe.last_load, loads[d])
    assert sorted(moe.experts) == [
        str(e) for e in range(topo.axis("ep").rank * E // ep, (topo.axis("ep").rank + 1) * E // ep)
    ]
    expert_group = topo.axis("edp").group
    ref_params = dict(ref.named_parameters())
    for name, p in moe.named_parameters():
        if not p.requires_grad:  # the aux-loss-free bias
            continue
        grad = p.grad.clone()
        if get_meta(p).reduce_over_tp:
            dist.all_reduce(grad, group=topo.axis("tp").group)
        group = expert_group if get_meta(p).is_expert else topo.axis("dp").group
        if group is not None:
            dist.all_reduce(grad, group=group)
        close(full_tensor(p, topo.axis("tp").group, grad / dp), ref_params[name].grad, f"grad {name}", rtol)
    return True


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("dp", "tp", "ep", "sequence_parallel"),
    [(2, 1, 2, False), pytest.param(2, 2, 2, True, marks=pytest.mark.slow)],
)
def test_sequence_wise_loss_at_expert_and_sequence_parallelism_matches_one_process(dp, tp, ep, sequence_parallel):
    """Under sequence parallelism each TP rank holds a slice of every sequence: the per-sequence
    counts and probabilities are those of the whole sequence, gathered before they are taken."""
    routing = {"sequence_aux_loss_coefficient": 0.2}
    world = dp * tp
    results = run_distributed(_ep_parity, world, dp, tp, ep, sequence_parallel, routing=routing, timeout_seconds=120)
    assert results == [True] * world


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("dp", "tp", "ep", "sequence_parallel"),
    [(2, 1, 2, False), pytest.param(2, 2, 2, True, marks=pytest.mark.slow)],
)
def test_global_aux_loss_is_one_micro_batch_of_every_rank_s_sequences(dp, tp, ep, sequence_parallel):
    """``global_aux_loss``: f and P over the same micro-batch of every DP rank, so dp2 equals one
    process running both ranks' sequences as one micro-batch (the loss, and every gradient)."""
    world = dp * tp
    routing = {"global_aux_loss": True, "aux_loss_coefficient": 0.3}
    results = run_distributed(_ep_parity, world, dp, tp, ep, sequence_parallel, routing=routing, timeout_seconds=120)
    assert results == [True] * world


def get_meta(p):
    from scaling.nn import get_parameter_meta

    return get_parameter_meta(p)


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("dp", "tp", "ep", "sequence_parallel"),
    [
        (2, 1, 2, False),
        pytest.param(4, 1, 4, False, marks=pytest.mark.slow),
        pytest.param(4, 1, 2, False, marks=pytest.mark.slow),  # experts replicated over 2 of the 4 DP ranks
        pytest.param(2, 2, 2, True, marks=pytest.mark.slow),  # tp2 inside each expert, sequence parallel
        pytest.param(2, 2, 1, False, marks=pytest.mark.slow),  # tp2 inside each expert, no EP
    ],
)
def test_expert_parallel_matches_one_process(dp, tp, ep, sequence_parallel):
    world = dp * tp
    assert run_distributed(_ep_parity, world, dp, tp, ep, sequence_parallel, timeout_seconds=120) == [True] * world


@pytest.mark.distributed
def test_deepseek_v3_routing_at_ep2_matches_one_process():
    """Sigmoid, aux-loss-free bias, groups of 2 experts with one kept, scaling 2.5: every rank's
    output and gradients are one process's."""
    routing = dict(score_function="sigmoid", balancing="aux_loss_free", num_groups=2, top_groups=1,
                   routed_scaling_factor=2.5)  # fmt: skip
    assert run_distributed(_ep_parity, 2, 2, 1, 2, False, torch.float32, routing, timeout_seconds=120) == [True] * 2


@pytest.mark.distributed
@pytest.mark.slow
def test_expert_parallel_in_bf16_with_grouped_experts_matches_one_process():
    """bf16: the experts run as grouped matrix multiplies (rows from both EP ranks, regrouped by
    expert) and match one process within bf16's rounding."""
    assert run_distributed(_ep_parity, 2, 2, 1, 2, False, torch.bfloat16, timeout_seconds=120) == [True] * 2


def test_bad_configuration_names_values_and_choices():
    with pytest.raises(
        ValueError, match=r"num_experts=6 is not divisible by expert_parallel_size=4; choose .* \[1, 2, 3, 6\]"
    ):
        check_moe(6, 2, 4, "softmax", "aux_loss")
    with pytest.raises(ValueError, match=r"top_k=5 must be between 1 and num_experts=4"):
        check_moe(4, 5, 1, "softmax", "aux_loss")
    with pytest.raises(ValueError, match=r"score_function='relu'; choose one of \['softmax', 'sigmoid'\]"):
        check_moe(4, 2, 1, "relu", "aux_loss")
    with pytest.raises(
        ValueError, match=r"num_groups=3 must divide num_experts=8 into groups of at least 2 .* \[1, 2, 4\]"
    ):
        check_moe(8, 2, 1, "sigmoid", "aux_loss_free", num_groups=3)
    with pytest.raises(
        ValueError, match=r"top_groups=1 must be between 1 and num_groups=4, and its groups must hold top_k=4"
    ):
        check_moe(8, 4, 1, "sigmoid", "aux_loss_free", num_groups=4, top_groups=1)
    with pytest.raises(ValueError, match=r"balancing='capacity'; choose one of"):
        ParallelMoE(MoEConfig(H, FFN, E, balancing="capacity"))
