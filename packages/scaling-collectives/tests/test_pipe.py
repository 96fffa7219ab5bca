import dataclasses
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist

from scaling.collectives import PipeTransport, batch_send_recv, tensors_requiring_grad
from scaling.testing import assert_parity, make_topology, run_distributed


@dataclasses.dataclass
class Activations:
    hidden: torch.Tensor
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor
    layer: int


class Pair(NamedTuple):
    a: torch.Tensor
    b: object


def _messages():
    """Every supported pytree kind, in the order stage 0 sends them."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 3, 4, generator=g)
    return [
        torch.randn(2, 4, generator=g),
        (torch.randn(3, generator=g), torch.arange(4)),
        [torch.ones(2, dtype=torch.bfloat16), None, 5],
        {"x": torch.randn(2, 2, generator=g).t(), "mask": torch.rand(3, generator=g) > 0.5, "name": "mb0"},
        Activations(hidden, torch.ones(2, 3, dtype=torch.bool), torch.arange(3), layer=4),
        Pair(
            torch.randn(1, generator=g, dtype=torch.float64),
            {"nested": (None, 2.5, [torch.zeros(0, 2), torch.tensor(3.5, dtype=torch.float16)])},
        ),
        None,
        7,
    ]


def _assert_same(actual, expected, path="obj"):
    assert type(actual) is type(expected), f"{path}: {type(actual)} vs {type(expected)}"
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype, path
        assert_parity(actual.detach(), expected.detach(), bitwise=True, name=path)
    elif dataclasses.is_dataclass(expected):
        for f in dataclasses.fields(expected):
            _assert_same(getattr(actual, f.name), getattr(expected, f.name), f"{path}.{f.name}")
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), path
        for k in expected:
            _assert_same(actual[k], expected[k], f"{path}[{k!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), path
        for i, (a, e) in enumerate(zip(actual, expected)):
            _assert_same(a, e, f"{path}[{i}]")
    else:
        assert actual == expected, path


def _round_trip():
    topo = make_topology(pipe_parallel_size=2)
    transport = PipeTransport(topo.axis("pp").previous, topo.axis("pp").next, topo.device)
    for message in _messages():
        if topo.axis("pp").is_first:
            transport.send_forward(message)
        else:
            _assert_same(transport.recv_forward(), message)
    return transport.handshakes_sent, transport.handshakes_received


@pytest.mark.distributed
def test_round_trip_every_pytree_kind():
    n = len(_messages())
    assert run_distributed(_round_trip, 2, timeout_seconds=60) == [(n, 0), (0, n)]


def _shape_changes():
    topo = make_topology(pipe_parallel_size=2)
    transport = PipeTransport(topo.axis("pp").previous, topo.axis("pp").next, topo.device)
    shapes = [(2, 4), (2, 4), (2, 4), (3, 4), (3, 4), (2, 4)]
    for i, shape in enumerate(shapes):
        x = torch.full(shape, float(i))
        if topo.axis("pp").is_first:
            transport.send_forward({"x": x})
        else:
            got = transport.recv_forward()["x"]
            assert_parity(got, x, bitwise=True, name=f"message {i}")
    # The steady state reuses the cached handshake; each change re-handshakes once.
    return transport.handshakes_sent + transport.handshakes_received


@pytest.mark.distributed
def test_shape_change_mid_run_rehandshakes():
    assert run_distributed(_shape_changes, 2, timeout_seconds=60) == [3, 3]


def _steady_state_transfers():
    """Transfers per message, from the recorder: one frame once the metadata is cached, 1 + 2 on a change."""
    from scaling.collectives import get_recorder

    topo = make_topology(pipe_parallel_size=2)
    transport = PipeTransport(topo.axis("pp").previous, topo.axis("pp").next, topo.device)
    counts = []
    for shape in [(2, 4), (2, 4), (2, 4), (3, 4)]:
        before = sum(get_recorder().p2p_snapshot()[1].values())
        if topo.axis("pp").is_first:
            transport.send_forward({"x": torch.ones(shape), "y": torch.zeros(shape)})
        else:
            assert transport.recv_forward()["x"].shape == shape
        counts.append(sum(get_recorder().p2p_snapshot()[1].values()) - before)
    return counts


@pytest.mark.distributed
def test_cached_metadata_means_one_transfer_per_message():
    # First message and shape change: frame, then metadata + payload; otherwise the
    # header rides in the payload's frame (no metadata round trip).
    expected = [3, 1, 1, 3]
    assert run_distributed(_steady_state_transfers, 2, timeout_seconds=60) == [expected, expected]


def _sends_in_flight():
    """Stage 0 posts every send without waiting; stage 1 receives them later, in order."""
    topo = make_topology(pipe_parallel_size=2)
    transport = PipeTransport(topo.axis("pp").previous, topo.axis("pp").next, topo.device)
    shapes = [(2, 3), (2, 3), (4, 3), (4, 3)]  # a shape change (handshake) among sends in flight
    if topo.axis("pp").is_first:
        for i, shape in enumerate(shapes):
            transport.send_forward(torch.full(shape, float(i)), wait=False)
        posted = transport.pending_sends  # sends not yet collected (some may have completed)
        dist.barrier(group=topo.axis("pp").group)  # all four posted before stage 1 receives any
        got = transport.recv_backward()  # stage 1 answers only after receiving everything
        transport.wait_sends()
        return posted > 0, transport.pending_sends, float(got[0].sum())
    dist.barrier(group=topo.axis("pp").group)
    total = 0.0
    for i, shape in enumerate(shapes):
        x = transport.recv_forward()
        assert_parity(x, torch.full(shape, float(i)), bitwise=True, name=f"message {i}")
        total += float(x.sum())
    transport.send_backward([torch.full((1,), total)], wait=False)
    transport.wait_sends()
    return True, transport.pending_sends, total


@pytest.mark.distributed
def test_sends_left_in_flight_arrive_in_order():
    total = 6 * (0 + 1) + 12 * (2 + 3)
    assert run_distributed(_sends_in_flight, 2, timeout_seconds=60) == [(True, 0, total), (True, 0, total)]


def _ring_of_two():
    """Two stages in a ring: each is the other's previous and next stage."""
    me, other = dist.get_rank(), 1 - dist.get_rank()
    transport = PipeTransport(other, other, torch.device("cpu"), ring=True)
    seen = []
    for step, rows in enumerate([2, 2, 3]):  # the last step changes shapes: re-handshake mid-ring
        act = torch.full((rows, 4), 10.0 * me + step)
        grad = torch.full((rows, 2), -10.0 * me - step)
        got_act = transport.send_forward_recv_forward(act)
        got_grad = transport.send_backward_recv_backward([grad])
        both = transport.exchange(send_forward=[act], recv_forward=True, send_backward=[grad], recv_backward=True)
        for a in (got_act, both[0][0]):
            assert_parity(a, torch.full((rows, 4), 10.0 * other + step), bitwise=True, name="activation")
        for g in (got_grad[0], both[1][0]):
            assert_parity(g, torch.full((rows, 2), -10.0 * other - step), bitwise=True, name="gradient")
        seen.append(transport.handshakes_received)
    return seen


@pytest.mark.distributed
def test_ring_of_two_exchanges_both_ways_in_order():
    # Handshakes: forward tensor, grads, forward list (structure change) at step 0; the
    # forward channel alternates tensor / list so it re-handshakes every call; step 2's
    # new shapes change the grads too.
    assert run_distributed(_ring_of_two, 2, timeout_seconds=60) == [[3, 5, 8], [3, 5, 8]]


def _both_neighbours_on_one_channel():
    """Rank 1 receives activations from rank 0 (a tensor) and rank 2 (a list of two), as a stage of a
    V does from its two neighbours, and sends each a different structure back: one handshake per
    (channel, peer), none after the first round."""
    me = dist.get_rank()
    transport = PipeTransport(None, None, torch.device("cpu"))
    got = []
    for step in range(3):
        if me == 1:
            received = transport.transfer(
                sends=[
                    ("backward", 0, [torch.full((2,), 1.0 + step)]),
                    ("backward", 2, [torch.ones(3), torch.ones(1)]),
                ],
                receives=[("forward", 0), ("forward", 2)],
            )
            got.append([x.tolist() if isinstance(x, torch.Tensor) else [t.tolist() for t in x] for x in received])
        else:
            obj = torch.full((2,), 10.0 * me + step) if me == 0 else [torch.full((1,), 1.0 * step), torch.zeros(2)]
            (grads,) = transport.transfer(sends=[("forward", 1, obj)], receives=[("backward", 1)])
            got.append([g.tolist() for g in grads])
    return got, transport.handshakes_received, transport.handshakes_sent


@pytest.mark.distributed
def test_a_stage_talks_to_both_neighbours_on_one_channel_with_a_cache_per_peer():
    results = run_distributed(_both_neighbours_on_one_channel, 3, timeout_seconds=60)
    middle, handshakes, sent = results[1]
    assert middle == [
        [[0.0, 0.0], [[0.0], [0.0, 0.0]]],
        [[1.0, 1.0], [[1.0], [0.0, 0.0]]],
        [[2.0, 2.0], [[2.0], [0.0, 0.0]]],
    ]
    assert (handshakes, sent) == (2, 2)  # one per peer, in the first round only
    assert results[0] == ([[[1.0, 1.0]], [[2.0, 2.0]], [[3.0, 3.0]]], 1, 1)
    assert results[2] == ([[[1.0, 1.0, 1.0], [1.0]]] * 3, 1, 1)


def _two_stage_pipeline():
    """1F1B over two stages with the batched calls; grads match one process."""
    topo = make_topology(pipe_parallel_size=2)
    transport = PipeTransport(topo.axis("pp").previous, topo.axis("pp").next, topo.device)
    g = torch.Generator().manual_seed(3)
    w0, w1 = torch.randn(4, 5, generator=g), torch.randn(5, 3, generator=g)
    micro_batches = [torch.randn(2, 4, generator=g), torch.randn(3, 4, generator=g)]  # shapes differ
    targets = [torch.randn(2, 3, generator=g), torch.randn(3, 3, generator=g)]

    ref_w0, ref_w1 = w0.clone().requires_grad_(), w1.clone().requires_grad_()
    for x, y in zip(micro_batches, targets):
        (((x @ ref_w0).tanh() @ ref_w1 - y) ** 2).sum().backward()

    if topo.axis("pp").is_first:
        w = w0.clone().requires_grad_()
        outs = [
            {"h": (x @ w).tanh(), "scale": torch.tensor(1.0), "step": i, "y": None} for i, x in enumerate(micro_batches)
        ]
        transport.send_forward(outs[0])
        grads0 = transport.send_forward_recv_backward(outs[1])
        outs[0]["h"].backward(grads0[0])
        grads1 = transport.recv_backward()
        outs[1]["h"].backward(grads1[0])
        assert len(grads0) == 1 and grads1[0].shape == (3, 5)
        assert_parity(w.grad, ref_w0.grad, rtol=1e-5, atol=1e-6, name="stage 0 weight grad")
    else:
        w = w1.clone().requires_grad_()

        def run(inputs):
            assert inputs["h"].is_leaf and inputs["h"].requires_grad and not inputs["scale"].requires_grad
            (((inputs["h"] @ w) * inputs["scale"] - targets[inputs["step"]]) ** 2).sum().backward()
            return [t.grad for t in tensors_requiring_grad(inputs)]

        inputs = transport.recv_forward()
        inputs = transport.send_backward_recv_forward(run(inputs))
        transport.send_backward(run(inputs))
        assert_parity(w.grad, ref_w1.grad, rtol=1e-5, atol=1e-6, name="stage 1 weight grad")
    return True


@pytest.mark.distributed
def test_two_way_exchange_matches_single_process():
    assert run_distributed(_two_stage_pipeline, 2, timeout_seconds=60) == [True, True]


def _simultaneous_send():
    """Both ranks send a large tensor to each other at once: batched, so no deadlock."""
    me, other = dist.get_rank(), 1 - dist.get_rank()
    # rank 0 plays stage 0 (next = 1); rank 1 plays stage 1 (prev = 0).
    transport = PipeTransport(None if me == 0 else other, other if me == 0 else None, torch.device("cpu"))
    big = torch.full((256, 1024), float(me))  # 1 MiB each way
    got = transport.send_forward_recv_backward(big) if me == 0 else transport.send_backward_recv_forward([big])
    received = got[0] if me == 0 else got
    return float(received.mean())


@pytest.mark.distributed
def test_simultaneous_two_way_send_does_not_deadlock():
    assert run_distributed(_simultaneous_send, 2, timeout_seconds=60) == [1.0, 0.0]


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match=r"prev_rank=-1 must be a global rank"):
        PipeTransport(-1, None, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"prev_rank and next_rank are both 1; .* ring of two \(ring=True\)"):
        PipeTransport(1, 1, torch.device("cpu"))
    assert PipeTransport(1, 1, torch.device("cpu"), ring=True).prev_rank == 1
    transport = PipeTransport(None, None, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"recv_forward: this is the first pipeline stage \(prev_rank=None\)"):
        transport.recv_forward()
    with pytest.raises(ValueError, match=r"send_forward: this is the last pipeline stage \(next_rank=None\)"):
        transport.send_forward(torch.ones(1))
    with pytest.raises(TypeError, match="grads must be a list of tensors"):
        PipeTransport(0, None, torch.device("cpu")).send_backward(torch.ones(1))
    with pytest.raises(ValueError, match=r"op 'bcast' \(peer 0\) is not one of 'send', 'recv'"):
        batch_send_recv([("send", torch.ones(1), 0), ("bcast", torch.ones(1), 0)])
    with pytest.raises(TypeError, match=r"forward pytree\['bad'\]: a set cannot be sent"):
        PipeTransport(None, 1, torch.device("cpu")).send_forward({"bad": {1, 2}})


class PlainIO:
    """The original library's LayerIO style: a plain class; its instance attributes travel."""

    def __init__(self, activations, extra=None):
        self.activations, self.extra = activations, extra


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        (Activations(torch.ones(1), None, torch.ones(1), layer={1}), r"forward pytree\.layer: a set cannot be sent"),
        (Pair(torch.ones(1), [None, object()]), r"forward pytree\.b\[1\]: a object cannot be sent"),
        ((torch.ones(1), {"k": (1, {2})}), r"forward pytree\[1\]\['k'\]\[1\]: a set cannot be sent"),
        ({(1, 2): torch.ones(1)}, r"forward pytree: dict key \(1, 2\) of type tuple is not supported"),
        (PlainIO(torch.ones(1), {3}), r"forward pytree\.extra: a set cannot be sent"),
        (torch.nn.Linear(1, 1), r"forward pytree: a Linear cannot be sent"),
    ],
)
def test_unsendable_leaf_is_named_by_its_path(obj, message):
    with pytest.raises(TypeError, match=message):
        PipeTransport(None, 1, torch.device("cpu")).send_forward(obj)


def test_plain_class_objects_flatten_by_their_attributes():
    from scaling.collectives import _pytree

    obj = PlainIO(torch.arange(3.0), {"step": 2, "mask": torch.ones(2, dtype=torch.bool)})
    spec, tensors = _pytree.flatten(obj)
    back = _pytree.unflatten(spec, [t.clone() for t in tensors])
    assert type(back) is PlainIO and back.extra["step"] == 2
    assert torch.equal(back.activations, obj.activations) and torch.equal(back.extra["mask"], obj.extra["mask"])
    assert [t.data_ptr() for t in _pytree.tensor_leaves(obj)] == [t.data_ptr() for t in tensors]


def _static_shapes_exchange():
    """1F1B-style exchanges with static shapes: values, grad leaves and message sizes."""
    from scaling.collectives import get_recorder

    topo = make_topology(pipe_parallel_size=2)
    transport = PipeTransport(topo.axis("pp").previous, topo.axis("pp").next, topo.device, static_shapes=True)
    sizes = []
    for i in range(4):
        # Two tensors, the first 12 bytes (padded to 16 in the frame), the second a grad leaf.
        act = Activations(torch.full((3,), float(i)), None, torch.arange(8.0).view(2, 4) * i, layer=2)
        act.position_ids.requires_grad_(True)
        grads = [torch.full((2, 4), -float(i - 1))]  # the previous micro-batch's
        start = len(get_recorder().records())
        if topo.axis("pp").is_first:
            got = transport.exchange(send_forward=act, recv_backward=i > 0, wait_sends=False)[1]
            if i > 0:
                _assert_same(got, [torch.full((2, 4), -float(i - 1))])
        else:
            got = transport.exchange(send_backward=grads if i > 0 else None, recv_forward=True)[0]
            _assert_same(got, act)
            assert got.position_ids.requires_grad and not got.hidden.requires_grad
        sizes.append(sorted((r.op, r.nbytes) for r in get_recorder().records()[start:]))
    transport.wait_sends()
    if not topo.axis("pp").is_first:
        transport.send_backward([torch.full((2, 4), -3.0)])
    else:
        _assert_same(transport.recv_backward(), [torch.full((2, 4), -3.0)])
    return sizes, transport.handshakes_sent, transport.handshakes_received


@pytest.mark.distributed
def test_static_shapes_send_payload_only_after_the_first_message():
    (sizes0, sent0, got0), (sizes1, sent1, got1) = run_distributed(_static_shapes_exchange, 2, timeout_seconds=60)
    assert (sent0, got0, sent1, got1) == (1, 1, 1, 1)  # one handshake per channel, then none
    # Steady state: one transfer per message, exactly the payload (16 + 32 bytes forward, 32 backward).
    assert sizes0[2:] == [[("recv", 32), ("send", 48)]] * 2
    assert sizes1[2:] == [[("recv", 48), ("send", 32)]] * 2


def _static_shape_change():
    from scaling.collectives import get_recorder

    topo = make_topology(pipe_parallel_size=2)
    transport = PipeTransport(topo.axis("pp").previous, topo.axis("pp").next, topo.device, static_shapes=True)
    if topo.axis("pp").is_first:
        transport.send_forward({"x": torch.ones(2, 4)})
        before = len(get_recorder().records())
        try:
            transport.send_forward({"x": torch.ones(3, 4)}, wait=False)
        except ValueError as exc:
            return str(exc), len(get_recorder().records()) == before
        return "no error", False
    transport.recv_forward()
    return "", True


@pytest.mark.distributed
def test_static_shapes_refuse_a_changed_pytree_before_sending():
    message, nothing_posted = run_distributed(_static_shape_change, 2, timeout_seconds=60)[0]
    assert nothing_posted
    assert "static_shapes=True" in message and "forward pytree for rank 1 changed" in message, message
    assert "dict of [(2, 4) float32] became dict of [(3, 4) float32]" in message, message
    assert "static_shapes=False" in message


def _static_single_tensors():
    topo = make_topology(pipe_parallel_size=2)
    g = torch.Generator().manual_seed(1)
    messages = {
        torch.bool: [torch.rand(3, 5, generator=g) > 0.5 for _ in range(3)],
        torch.bfloat16: [torch.randn(4, 6, generator=g).to(torch.bfloat16).t() for _ in range(3)],  # non-contiguous
        torch.int64: [torch.randint(-9, 9, (7,), generator=g) for _ in range(3)],
    }
    for sent in messages.values():
        transport = PipeTransport(topo.axis("pp").previous, topo.axis("pp").next, topo.device, static_shapes=True)
        for x in sent:
            if topo.axis("pp").is_first:
                transport.send_forward((x,), wait=False)
            else:
                _assert_same(transport.recv_forward(), (x,))
        transport.wait_sends()
    return True


@pytest.mark.distributed
def test_static_single_tensors_travel_as_themselves():
    # After the handshake each message is the tensor in its own dtype and shape: bool,
    # bfloat16 (sent from a non-contiguous view) and int64 arrive bitwise.
    assert run_distributed(_static_single_tensors, 2, timeout_seconds=60) == [True, True]
