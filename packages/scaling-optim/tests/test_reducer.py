"""The DP traffic of one step, read from the collective recorder's counters.

ZeRO 1 and 2 reduce-scatter gradient buckets into the owned shards and all-gather the
updated shards: two model-sized transfers per step, as DDP's all-reduce, and no
all-reduce of gradients (only the 16-byte global-norm / non-finite all-reduce).
"""

import pytest
import torch

from scaling.collectives import get_recorder
from scaling.nn import ParameterMeta
from scaling.optim import GradientReducer, Optimizer, OptimizerConfig, OptimizerParamGroup, OptimizerParamGroupConfig
from scaling.testing import assert_parity, make_topology, run_distributed

SHAPES = {"w1": (6, 5), "b1": (6,), "w2": (3, 6), "b2": (3,)}  # b2 (3 elements) pads to 4 on DP = 2


def _two_layers(zero, topo):
    """The parameters of SHAPES (seeded) and their optimizer, with small buckets (several per backward)."""
    g = torch.Generator().manual_seed(0)
    params = {n: torch.nn.Parameter(torch.randn(s, generator=g)) for n, s in SHAPES.items()}
    triples = []
    for name, p in params.items():
        meta = ParameterMeta(name, tuple(p.shape), layer_index=0).attach(p).parameter_meta
        triples.append((meta.key, p, meta))
    opt = Optimizer(
        config=OptimizerConfig(zero_stage=zero, allreduce_bucket_size=100),
        parameter_groups=[OptimizerParamGroup(triples, OptimizerParamGroupConfig(name="all"))],
        topology=topo,
    )
    return params, opt


def _one_step(zero):
    topo = make_topology()
    params, opt = _two_layers(zero, topo)
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(1 + topo.axis("dp").rank))
    recorder = get_recorder()
    recorder.reset_counters()
    opt.zero_grad()
    h = torch.tanh(x @ params["w1"].t() + params["b1"])
    opt.backward((h @ params["w2"].t() + params["b2"]).pow(2).mean())
    opt.step()
    dp = recorder.group_name(topo.axis("dp").group)
    calls = {op: n for (op, group), n in recorder.calls_by_op_and_group().items() if group == dp}
    nbytes = {op: n for (op, group), n in recorder.bytes_by_op_and_group().items() if group == dp}
    return calls, nbytes


@pytest.mark.distributed
@pytest.mark.parametrize("zero", [0, 1, 2])
def test_dp_collectives_per_step(zero):
    padded = sum(-(-torch.Size(s).numel() // 2) * 2 for s in SHAPES.values()) * 4  # fp32 bytes, padded to DP = 2
    full = sum(torch.Size(s).numel() for s in SHAPES.values()) * 4
    for calls, nbytes in run_distributed(_one_step, 2, zero, timeout_seconds=120):
        if zero == 0:
            # the gradients in buckets, then the norm and the non-finite verdict (2 float64; experts under
            # expert parallelism add a third)
            assert nbytes == {"all_reduce": full + 16}, nbytes
            assert calls["all_reduce"] >= 3
        else:
            # reduce-scatter input: every rank's chunks; all-gather input: this rank's chunks
            assert nbytes == {"reduce_scatter": padded, "all_gather": padded // 2, "all_reduce": 16}, nbytes
            assert calls["all_reduce"] == 1 and calls["reduce_scatter"] >= 2


def _tied_sum_after_finish(zero):
    """As the pipeline does: finish the DP reduction, then change the tied weight's ``.grad``."""
    topo = make_topology()
    g = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(3, 5, generator=g))
    emb = torch.nn.Parameter(torch.randn(5, generator=g))  # odd numel: padded chunks
    ParameterMeta("w", (3, 5), layer_index=0).attach(w)
    ParameterMeta("emb", (5,), layer_index=0, tied_key="emb").attach(emb)
    opt = Optimizer(
        config=OptimizerConfig(zero_stage=zero),
        parameter_groups=[
            OptimizerParamGroup(
                [(p.parameter_meta.key, p, p.parameter_meta) for p in (w, emb)],
                OptimizerParamGroupConfig(name="all"),
            )
        ],
        topology=topo,
    )
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(1 + topo.axis("dp").rank))
    opt.zero_grad()
    opt.backward(((x * emb) @ w.t()).pow(2).mean())
    opt.finish_gradient_reduction()
    with torch.no_grad():
        emb.grad.mul_(2.0)  # stands in for the sum over two stages holding the same gradient
    opt.step()
    return w.detach().clone(), emb.detach().clone()


@pytest.mark.distributed
def test_tied_gradient_changed_after_finish_is_used_by_every_stage():
    """ZeRO 1/2 keep a tied parameter's reduced elements in ``.grad``, so a tied sum after finish counts."""
    expected = run_distributed(_tied_sum_after_finish, 2, 0, timeout_seconds=120)[0]
    for zero in (1, 2):
        for got in run_distributed(_tied_sum_after_finish, 2, zero, timeout_seconds=120):
            for a, b in zip(got, expected):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def _plain_parameters_parity(bucket_size_bytes):
    """GradientReducer.over_parameters: a torch-optimizer model's DP average, overlapped with backward."""
    topo = make_topology()  # all ranks data parallel
    dp, r = topo.axis("dp").size, topo.axis("dp").rank
    g = torch.Generator().manual_seed(11)
    x, y = torch.randn(6 * dp, 4, generator=g, dtype=torch.float64), torch.randn(6 * dp, 2, generator=g)

    def model():
        torch.manual_seed(0)
        # A float32 last layer puts a second dtype into the buckets.
        return torch.nn.ModuleList([torch.nn.Linear(4, 8).double(), torch.nn.Linear(8, 2)])

    def loss(m, rows):
        return torch.nn.functional.mse_loss(m[1](torch.tanh(m[0](x[rows])).float()), y[rows])

    reference, local = model(), model()
    # Two accumulated halves of the global batch, as two micro-batches.
    for half in (slice(0, 3 * dp), slice(3 * dp, 6 * dp)):
        (loss(reference, half) / 2).backward()
    reducer = GradientReducer.over_parameters(list(local.parameters()), topo.axis("dp").group, bucket_size_bytes)
    for half in (slice(3 * r, 3 * r + 3), slice(3 * dp + 3 * r, 3 * dp + 3 * r + 3)):
        (loss(local, half) / 2).backward()
    reducer.finish()
    for (name, p), ref in zip(local.named_parameters(), reference.parameters()):
        assert_parity(p.grad, ref.grad, name=name, rtol=1e-5, atol=1e-7)
    return len(reducer.buckets)


@pytest.mark.distributed
@pytest.mark.slow  # the quick tier stays under 2 minutes; the auto API's parity tests use this path too
@pytest.mark.parametrize("bucket_size_bytes", [64, 25_000_000], ids=["tiny-buckets", "one-bucket"])
def test_over_parameters_matches_the_full_batch_with_accumulation(bucket_size_bytes):
    buckets = run_distributed(_plain_parameters_parity, 2, bucket_size_bytes, timeout_seconds=60)
    # float32 and float64 never share a bucket; a 64-byte bucket closes once it holds 64 bytes
    # (in backward order: the float32 bias and weight together, then each float64 one apart).
    assert buckets == ([3, 3] if bucket_size_bytes == 64 else [2, 2])


def test_bad_bucket_size_is_named():
    with pytest.raises(ValueError, match=r"bucket_size_bytes=0 must be a positive int"):
        GradientReducer.over_parameters([torch.nn.Parameter(torch.zeros(2))], None, bucket_size_bytes=0)


def _accumulated_steps(zero):
    """Three micro-batches per step, reduced every pass, once (set_gradient_accumulation_steps) or after no_sync."""
    topo = make_topology()
    out = {}
    for how in ("every", "accumulate", "no_sync"):
        params, opt = _two_layers(zero, topo)
        if how == "accumulate":
            opt.set_gradient_accumulation_steps(3)
        recorder = get_recorder()
        recorder.reset_counters()
        for step in range(2):
            opt.zero_grad()
            for micro in range(3):
                seed = 100 * step + 10 * micro + topo.axis("dp").rank
                x = torch.randn(4, 5, generator=torch.Generator().manual_seed(seed))
                h = torch.tanh(x @ params["w1"].t() + params["b1"])
                loss = (h @ params["w2"].t() + params["b2"]).pow(2).mean() / 3
                if how == "no_sync" and micro < 2:
                    with opt.no_sync():
                        opt.backward(loss)
                else:
                    opt.backward(loss)
            opt.step()
        dp = recorder.group_name(topo.axis("dp").group)
        op = "all_reduce" if zero == 0 else "reduce_scatter"
        calls = recorder.calls_by_op_and_group().get((op, dp), 0)
        out[how] = ({n: p.detach().clone() for n, p in params.items()}, calls)
    return out


@pytest.mark.distributed
@pytest.mark.slow  # the quick tier stays under 2 minutes
@pytest.mark.parametrize("zero", [0, 1, 2])
def test_accumulated_micro_batches_reduce_once_per_step(zero):
    for out in run_distributed(_accumulated_steps, 2, zero, timeout_seconds=120):
        every_params, every_calls = out["every"]
        for how in ("accumulate", "no_sync"):
            params, calls = out[how]
            for name, p in params.items():  # summing before or after the average: rounding only
                assert_parity(p, every_params[name], name=f"{how} {name}", rtol=1e-6, atol=1e-7)
            norm_calls = 2 if zero == 0 else 0  # ZeRO 0: the norm/verdict all-reduce, once per step
            per_pass = (every_calls - norm_calls) // 6  # buckets launched by one backward pass
            assert per_pass >= 2, every_calls  # several buckets, or the counts below would prove little
            if zero == 2 and how == "accumulate":
                # ZeRO-2 reduces every pass: a full gradient must not outlive its backward.
                assert calls == every_calls, (how, calls, every_calls)
            else:
                assert calls - norm_calls == 2 * per_pass, (how, calls, every_calls)


def test_bad_gradient_accumulation_steps_are_named():
    reducer = GradientReducer.over_parameters([torch.nn.Parameter(torch.zeros(2))], None)
    with pytest.raises(ValueError, match=r"backwards=0 must be a positive int"):
        reducer.accumulate(0)


def _bf16_gradients(g: torch.Generator) -> torch.Tensor:
    """A (16, 8) bf16 gradient whose entries span 2^-6..2^6: a bf16 sum of four of them rounds often."""
    scale = 2.0 ** torch.randint(-6, 7, (16, 8), generator=g)
    return (torch.randn(16, 8, generator=g) * scale).to(torch.bfloat16)


def _bf16_layer(zero, fp32, topo):
    """A bf16 (16, 8) linear without bias and its optimizer."""
    layer = torch.nn.Linear(8, 16, bias=False).to(torch.bfloat16)
    meta = ParameterMeta("w", (16, 8), layer_index=0).attach(layer.weight).parameter_meta
    opt = Optimizer(
        config=OptimizerConfig(zero_stage=zero, grad_reduce_in_fp32=fp32),
        parameter_groups=[OptimizerParamGroup([(meta.key, layer.weight, meta)], OptimizerParamGroupConfig(name="w"))],
        topology=topo,
        zero3_modules=[layer] if zero == 3 else None,
    )
    return layer, opt


def _backward(layer, opt, grad):
    """A backward pass that leaves exactly ``grad`` (16, 8): y = I W^T = W^T, and the gradient
    of sum(y * grad^T) with respect to W is grad."""
    opt.backward((layer(torch.eye(8, dtype=torch.bfloat16)) * grad.t()).sum())


def _reduced_bf16(zero, fp32_reduce, shard_size):
    topo = make_topology(data_parallel_shard_size=shard_size)
    layer, opt = _bf16_layer(zero, fp32_reduce, topo)
    recorder = get_recorder()
    recorder.reset_counters()
    opt.zero_grad()
    _backward(layer, opt, _bf16_gradients(torch.Generator().manual_seed(topo.axis("dp").rank)))
    opt.finish_gradient_reduction()
    (slot,) = opt.slots
    dp = recorder.group_name(topo.axis("dp").group)
    # The gradient's bytes: ZeRO-3's parameter all-gathers (recorded too) are not counted.
    sent = sum(n for (op, group), n in recorder.bytes_by_op_and_group().items() if group == dp and op != "all_gather")
    return slot.start, slot.end, slot.owned_grad().float(), sent


@pytest.mark.distributed
@pytest.mark.parametrize(
    "zero, shard_size",
    [(0, None), (1, None), (2, None), (3, None), (3, 2)],
    ids=["zero0", "zero1", "zero2", "zero3", "hsdp"],
)
def test_bf16_gradients_are_summed_in_fp32_over_data_parallel_ranks(zero, shard_size):
    """Megatron-LM and torchtitan reduce bf16 gradients in fp32; so does the optimizer by default.
    The DP mean then is the exact mean of the ranks' bf16 gradients, rounded once to bf16 where it
    lands in ``.grad`` (ZeRO 0 and 1) and not at all in the fp32 gradient shards (ZeRO 2, 3, HSDP).
    Reduced in bf16 (``grad_reduce_in_fp32=False``) the sum is rounded at every step and differs;
    fp32 sends twice its bytes."""
    exact = sum(_bf16_gradients(torch.Generator().manual_seed(r)).double() for r in range(4)) / 4
    expected = (exact.to(torch.bfloat16) if zero < 2 else exact).float().reshape(-1)
    for fp32_reduce in (True, False):
        for start, end, got, sent in run_distributed(
            _reduced_bf16, 4, zero, fp32_reduce, shard_size, timeout_seconds=120
        ):
            assert torch.equal(got, expected[start:end]) == fp32_reduce, (fp32_reduce, start, end)
            if shard_size is None:  # the whole (16, 8) gradient went out once: 4 or 2 bytes an element
                assert sent == 128 * (4 if fp32_reduce else 2), sent


def _accumulated_bf16(zero, fp32, micro_batches):
    topo = make_topology()
    layer, opt = _bf16_layer(zero, fp32, topo)
    g = torch.Generator().manual_seed(10 * topo.axis("dp").rank)
    opt.zero_grad()
    opt.set_gradient_accumulation_steps(micro_batches)
    between = []
    for _ in range(micro_batches):
        _backward(layer, opt, _bf16_gradients(g))
        between.append(layer.weight.grad is None)
    opt.finish_gradient_reduction()
    (slot,) = opt.slots
    return slot.start, slot.end, slot.owned_grad().float(), between


@pytest.mark.distributed
@pytest.mark.parametrize("zero, dp", [(0, 1), (0, 2), (1, 2)])
def test_bf16_gradients_of_a_steps_micro_batches_are_summed_in_fp32(zero, dp):
    """Megatron-LM sums bf16 micro-batch gradients in fp32 (main_grad); autograd's ``.grad`` would
    round the sum to bf16 in every pass. With ZeRO 0/1 the fp32 sum goes back into ``.grad``
    rounded once, in the last pass (``.grad`` is None before it), then the DP mean (in fp32)
    rounds once more."""
    n = 4
    sums = []
    for rank in range(dp):
        g = torch.Generator().manual_seed(10 * rank)
        sums.append(sum(_bf16_gradients(g).double() for _ in range(n)).to(torch.bfloat16))
    expected = (sum(s.double() for s in sums) / dp).to(torch.bfloat16).float().reshape(-1)
    for fp32 in (True, False):
        for start, end, got, between in run_distributed(_accumulated_bf16, dp, zero, fp32, n, timeout_seconds=120):
            assert torch.equal(got, expected[start:end]) == fp32, (fp32, start, end)
            assert between == [fp32] * (n - 1) + [False]
