"""Schedules checked offline by the simulator: no deadlock, exact peaks, bubbles equal theory."""

from __future__ import annotations

import pytest

from scaling.pipeline import (
    Backward,
    Exchange,
    Forward,
    LoadMicroBatch,
    RecvActivation,
    ScheduleError,
    SendActivation,
    forward_only_schedule,
    gpipe_schedule,
    interleaved_1f1b_schedule,
    one_f_one_b_schedule,
    simulate,
    simulate_schedule,
    stage_of,
    virtual_stage,
    zb_h1_schedule,
    zb_v_schedule,
)
from scaling.pipeline.schedules.interleaved import group_size

STAGES = range(1, 9)
MICRO_BATCHES = range(1, 17)


@pytest.mark.parametrize("p", STAGES)
def test_gpipe_peak_is_m_and_bubble_matches_theory(p: int) -> None:
    for m in MICRO_BATCHES:
        r = simulate_schedule(gpipe_schedule, p, m)
        assert r.peak_activations == (m,) * p
        assert r.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)


@pytest.mark.parametrize("p", STAGES)
def test_1f1b_peak_is_p_minus_stage_and_bubble_matches_theory(p: int) -> None:
    for m in MICRO_BATCHES:
        r = simulate_schedule(one_f_one_b_schedule, p, m)
        assert r.peak_activations == tuple(min(m, p - s) for s in range(p))
        assert r.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)


@pytest.mark.parametrize("p", STAGES)
def test_interleaved_halves_the_bubble(p: int) -> None:
    v = 2
    costs = {"forward": 1.0 / v, "backward": 2.0 / v}  # a chunk holds 1/v of the stage's layers
    for m in MICRO_BATCHES:
        if m % group_size(p, m):
            with pytest.raises(ValueError, match=f"num_micro_batches={m} does not split"):
                interleaved_1f1b_schedule(p, m, 0, v)
            continue
        r = simulate_schedule(interleaved_1f1b_schedule, p, m, v, costs=costs, send_semantics="buffered")
        plain = (p - 1) / (m + p - 1)
        if m >= p:
            assert r.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
        else:  # fewer micro-batches than stages: still no worse than 1F1B
            assert r.bubble_fraction <= plain + 1e-12
        assert max(r.peak_activations) <= v * m


@pytest.mark.parametrize("p", STAGES)
def test_interleaved_is_deadlock_free_with_blocking_sends(p: int) -> None:
    # Sends that wait for their receiver (gloo, NCCL, the executor): the lockstep rounds
    # pair every send with a receive posted in the same batched exchange, ring included.
    v = 2
    costs = {"forward": 1.0 / v, "backward": 2.0 / v}
    for m in MICRO_BATCHES:
        if m % group_size(p, m):
            continue
        r = simulate_schedule(interleaved_1f1b_schedule, p, m, v, costs=costs, send_semantics="rendezvous")
        if m >= p:
            assert r.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
        assert max(r.peak_activations) <= v * m


def test_interleaved_steady_state_posts_all_four_transfers_at_once() -> None:
    program = interleaved_1f1b_schedule(2, 4, 0, 2)
    exchanges = [i for i in program if isinstance(i, Exchange)]
    kinds = {tuple(type(op).__name__ for op in e.ops) for e in exchanges}
    assert ("SendActivation", "RecvActivation", "SendGrad", "RecvGrad") in kinds
    assert ("SendActivation", "RecvActivation") in kinds  # warm-up: send_forward_recv_forward
    # On two stages both neighbours are stage 1 (the ring): every transfer goes to or comes from it.
    assert {op.peer for e in exchanges for op in e.ops} == {1}


@pytest.mark.parametrize("p", STAGES)
def test_zb_h1_beats_1f1b_with_the_same_memory(p: int) -> None:
    split = {"forward": 1.0, "backward_input": 1.0, "backward_weight": 1.0}
    for m in MICRO_BATCHES:
        zb = simulate_schedule(zb_h1_schedule, p, m, costs=split)
        ref = simulate_schedule(one_f_one_b_schedule, p, m, costs={"forward": 1.0, "backward": 2.0})
        assert zb.peak_activations == tuple(min(m, p - s) for s in range(p))
        if p > 1:
            assert zb.bubble_fraction < ref.bubble_fraction
        # Lower bound: even a perfect schedule waits (p - 1) forwards + input-grads.
        assert zb.bubble_fraction >= (p - 1) / (3 * m + p - 1) - 1e-12


@pytest.mark.parametrize("p", [2, 4, 8])
def test_zb_v_idles_only_while_the_pipeline_fills_and_holds_1f1b_s_memory(p: int) -> None:
    # Equal costs per chunk (F = I = W): every stage busy 6m, and the step 6m + p - 1, the
    # least possible (the last stage cannot start before the first micro-batch reaches it).
    # Rendezvous: deadlock-free with sends that wait for their receiver.
    unit = {"forward": 1.0, "backward_input": 1.0, "backward_weight": 1.0}
    for m in range(2 * p, 4 * p + 1):
        r = simulate_schedule(zb_v_schedule, p, m, costs=unit, send_semantics="rendezvous")
        assert r.busy == (6.0 * m,) * p
        assert r.makespan == 6 * m + p - 1
        assert r.bubble_fraction == pytest.approx((p - 1) / (6 * m + p - 1), abs=1e-12)
        # 2p chunk activations (half a stage each) on every stage: 1F1B's first stage's p whole ones.
        assert r.peak_activations == (2 * p,) * p
        one_f_one_b = simulate_schedule(one_f_one_b_schedule, p, m, costs={"forward": 2.0, "backward": 4.0})
        # Each stage idles a sixth of 1F1B's (p - 1)(F + B) for the same layers (F = 2, B = 4 per stage).
        assert r.makespan - 6 * m == (one_f_one_b.makespan - 6 * m) / 6


def test_a_message_latency_lengthens_the_step_by_what_it_adds_to_the_critical_path() -> None:
    # 1F1B at p = 2, m = 1: F0, send, F1 (loss), B1, send, B0: two messages on the path.
    plain = simulate_schedule(one_f_one_b_schedule, 2, 1)
    slow = simulate_schedule(one_f_one_b_schedule, 2, 1, costs={"forward": 1.0, "backward": 2.0, "transfer": 0.25})
    assert slow.makespan == plain.makespan + 2 * 0.25 and slow.busy == plain.busy
    for semantics in ("rendezvous", "buffered"):  # ZB-V's plan has no slack: every hand-off lands on the path
        unit = {"forward": 1.0, "backward_input": 1.0, "backward_weight": 1.0}
        base = simulate_schedule(zb_v_schedule, 4, 8, costs=unit, send_semantics=semantics)
        late = simulate_schedule(zb_v_schedule, 4, 8, costs={**unit, "transfer": 0.1}, send_semantics=semantics)
        assert late.makespan > base.makespan


@pytest.mark.parametrize("p", STAGES)
def test_zb_v_runs_any_micro_batch_count_without_deadlock(p: int) -> None:
    for m in MICRO_BATCHES:
        for semantics in ("rendezvous", "buffered"):
            r = simulate_schedule(zb_v_schedule, p, m, send_semantics=semantics)
            assert max(r.peak_activations) <= 2 * p
        programs = [forward_only_schedule(p, m, s, 2, "v") for s in range(p)]
        forward_only = simulate(programs, send_semantics="rendezvous", placement="v")
        assert forward_only.busy == (2.0 * m,) * p


def test_zb_v_places_chunks_in_a_v_and_turns_without_a_message() -> None:
    p = 4
    assert [virtual_stage(s, c, p, "v") for c in (0, 1) for s in range(p)] == [0, 1, 2, 3, 7, 6, 5, 4]
    assert all(stage_of(virtual_stage(s, c, p, "v"), p, "v") == (s, c) for s in range(p) for c in (0, 1))
    last = zb_v_schedule(p, 8, p - 1)
    # The last stage hands chunk 0's output to its chunk 1 locally: it never sends to a stage after it.
    peers = {op.peer for i in last for op in (i.ops if isinstance(i, Exchange) else (i,)) if hasattr(op, "peer")}
    assert peers == {p - 2}
    first = zb_v_schedule(p, 8, 0)
    assert [i for i in first if isinstance(i, LoadMicroBatch)] == [LoadMicroBatch(mb) for mb in range(8)]
    with pytest.raises(ValueError, match="exactly 2 chunks"):
        zb_v_schedule(p, 8, 0, 3)


@pytest.mark.parametrize("p", STAGES)
def test_forward_only_has_no_backward(p: int) -> None:
    for m in (1, 5):
        r = simulate_schedule(forward_only_schedule, p, m)
        assert all(type(i) is Forward for row in r.timeline for _, _, i in row)


def test_instruction_reprs_are_precise() -> None:
    prog = one_f_one_b_schedule(2, 2, 0)
    assert repr(prog[:3]) == "[LoadMicroBatch(mb=0), Forward(mb=0, chunk=0), SendActivation(mb=0, chunk=0, to=1)]"
    # A schedule ends with its last backward: the tied-gradient sum and the update are the step's.
    assert repr(prog[-1:]) == "[Backward(mb=1, chunk=0)]"
    assert [i.short for i in interleaved_1f1b_schedule(2, 2, 0) if i.is_compute][:4] == ["F0", "F1", "F0.1", "F1.1"]


def test_render_shows_stage_by_time_grid() -> None:
    text = simulate_schedule(gpipe_schedule, 2, 2).render()
    # stage 1 runs B0 at t=3..5, so stage 0 waits until t=5 for its gradient
    assert text.splitlines()[1] == "stage 0: F0   F1   .    .    .    B0   -    B1   -"
    assert text.splitlines()[2] == "stage 1: .    F0   F1   B0   -    B1   -    .    ."


def test_deadlock_is_reported_with_the_grid() -> None:
    # Both stages wait for the other before sending: a cycle.
    stage0 = [RecvActivation(0, 1, 1), Forward(0, 0), SendActivation(0, 0, 1)]
    stage1 = [RecvActivation(0, 0, 0), Forward(0, 0), SendActivation(0, 0, 0)]
    with pytest.raises(ScheduleError, match=r"deadlock(.|\n)*stage 0: \[ra0.1\]"):
        simulate([stage0, stage1])


def test_message_order_mismatch_is_reported() -> None:
    stage0 = [
        LoadMicroBatch(0),
        Forward(0),
        SendActivation(0, 0, 1),
        LoadMicroBatch(1),
        Forward(1),
        SendActivation(1, 0, 1),
    ]
    stage1 = [RecvActivation(1, 0, 0), Forward(1), RecvActivation(0, 0, 0), Forward(0)]
    with pytest.raises(ScheduleError, match=r"expects \('activation', 1, 1\) but stage 0 sends \('activation', 0, 1\)"):
        simulate([stage0, stage1])
    with pytest.raises(
        ScheduleError, match=r"expects \('activation', 1, 1\) but the next message is \('activation', 0"
    ):
        simulate([stage0, stage1], send_semantics="buffered")


def test_backward_before_forward_is_reported() -> None:
    with pytest.raises(ScheduleError, match=r"Backward\(mb=0, chunk=0\) runs before its input"):
        simulate([[Backward(0), Forward(0)]])


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((0, 1, 0), "num_stages=0 must be an int >= 1"),
        ((2, 0, 0), "num_micro_batches=0"),
        ((2, 2, 2), r"stage=2 must be in \[0, num_stages=2\)"),
    ],
)
def test_bad_schedule_arguments(args: tuple[int, int, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        one_f_one_b_schedule(*args)


def test_png_needs_matplotlib(tmp_path) -> None:  # type: ignore[no-untyped-def]
    result = simulate_schedule(one_f_one_b_schedule, 2, 2)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=r"save_png needs matplotlib; pip install 'scaling-pipeline\[plot\]'"):
            result.save_png(str(tmp_path / "grid.png"))
    else:
        result.save_png(str(tmp_path / "grid.png"))
        assert (tmp_path / "grid.png").read_bytes()[:4] == b"\x89PNG"


def test_png_of_an_interleaved_schedule_is_a_real_picture(tmp_path) -> None:  # type: ignore[no-untyped-def]
    image = pytest.importorskip("matplotlib.image")
    path = tmp_path / "interleaved.png"
    simulate_schedule(interleaved_1f1b_schedule, 2, 4, 2).save_png(str(path))
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width >= 400 and height >= 100 and len(data) > 5_000
    pixels = image.imread(str(path))  # decodes: the file is a valid PNG
    assert pixels.shape[:2] == (height, width)
    # Coloured bars (F, B), labels and axes on white: not a blank canvas.
    colours = {tuple(round(float(c), 2) for c in px) for px in pixels.reshape(-1, pixels.shape[-1])[::7]}
    assert len(colours) > 4


def test_the_old_micro_batch_keyword_still_works_with_a_warning():
    from scaling.pipeline import gpipe_schedule, simulate_schedule

    with pytest.deprecated_call(match=r"use num_micro_batches="):
        old = gpipe_schedule(num_stages=2, num_microbatches=3, stage=0)
    assert old == gpipe_schedule(num_stages=2, num_micro_batches=3, stage=0)
    with pytest.deprecated_call(match=r"simulate_schedule\(num_microbatches=\.\.\.\) is deprecated"):
        assert simulate_schedule(gpipe_schedule, num_stages=2, num_microbatches=3).makespan > 0
