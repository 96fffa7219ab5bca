"""in_flight_peak: a stage's activation peak from the micro-batches its schedule keeps in flight."""

from __future__ import annotations

import pytest

from scaling.trainer.planning import in_flight_peak


@pytest.mark.parametrize(("stage", "held"), [(0, 4), (1, 3), (2, 2), (3, 1)])
def test_1f1b_stage_s_holds_p_minus_s_micro_batches_and_gpipe_all(stage, held):
    assert in_flight_peak([10], "1f1b", 4, 8, stage) == 10 * held
    assert in_flight_peak([10], "1f1b", 4, 2, stage) == 10 * min(held, 2)
    assert in_flight_peak([10], "gpipe", 4, 8, stage) == 80
    assert in_flight_peak([10], "1f1b", 4, 8, stage, at_backward=3) == 10 * held + 3


def test_one_stage_holds_one_micro_batch_however_many_accumulate():
    assert in_flight_peak([7], "1f1b", 1, 16, 0) == 7


def test_interleaving_weighs_each_chunk_s_micro_batches_by_their_own_bytes():
    # Stage 0 of p=2, v=2, m=4 runs F0 F1 F0.1 F1.1 F2 B0.1 F3 B1.1 F2.1 B0 ...: when B0 begins it holds
    # chunk 0's four micro-batches and chunk 1's third (the first two were freed by their backwards).
    assert in_flight_peak([100, 1], "interleaved_1f1b", 2, 4, 0) == 4 * 100 + 1
    assert in_flight_peak([1, 100], "interleaved_1f1b", 2, 4, 0) == 3 * 1 + 2 * 100  # at B0.1


def test_zb_h1_holds_a_micro_batch_until_its_weight_pass_with_what_the_input_pass_kept():
    assert in_flight_peak([5], "zb_h1", 2, 4, 0) == 2 * 5
    assert in_flight_peak([5], "zb_h1", 2, 4, 1) == 5
    # Stage 0 runs F0 F1 I0 W0 ...: at W0 it holds both micro-batches and I0's leftovers (3).
    assert in_flight_peak([5], "zb_h1", 2, 4, 0, weight_pass=[3]) == 2 * 5 + 3
    # ... and the gradients made so far from the first backward on: at W0, I0's.
    assert in_flight_peak([5], "zb_h1", 2, 4, 0, after_first=7, weight_pass=[3]) == 2 * 5 + 3 + 7


def test_sends_kept_until_the_step_ends_add_up_over_the_micro_batches():
    # 1F1B's last stage of 2 sends one gradient per micro-batch, after that micro-batch's backward: at
    # the last backward it holds the m - 1 earlier ones; the first stage has sent its m activations.
    assert in_flight_peak([0], "1f1b", 2, 8, 1, kept_sends=(100, 1)) == 7
    assert in_flight_peak([0], "1f1b", 2, 8, 0, kept_sends=(100, 1)) == 800
