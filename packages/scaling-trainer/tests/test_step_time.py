"""The step-time model's machine side: a profile's products, collectives and links, its JSON, the
shipped profiles, a pipeline's makespan from the schedule's programs, and the measuring command."""

from __future__ import annotations

import json
import math

import pytest

from scaling.trainer.planning import Link, MachineProfile, pipeline_seconds, spans_nodes
from scaling.trainer.planning._profile import main as profile_main


def _profile(**changes: object) -> MachineProfile:
    fields: dict[str, object] = dict(
        name="test",
        device="cpu",
        source="made in the test",
        devices_per_node=8,
        compute_slots=8,
        matmul={"fp32": ((1e6, 1e9), (1e9, 1e11))},
        memory_bandwidth=1e10,
        operator_overhead=1e-5,
        intra_node=Link(bandwidth=1e9, latency=1e-4),
        inter_node=Link(bandwidth=1e8, latency=1e-3),
    )
    fields.update(changes)
    return MachineProfile(**fields)  # type: ignore[arg-type]


def test_products_take_the_rate_of_their_size_interpolated_on_log_scales_and_clamped_at_the_ends():
    p = _profile()
    assert p.matmul_seconds(1e6, "fp32") == pytest.approx(1e6 / 1e9)
    assert p.matmul_seconds(1e9, "fp32", count=3) == pytest.approx(3 * 1e9 / 1e11)
    # halfway on the log of the size: halfway on the log of the rate
    assert p.matmul_seconds(10**7.5, "fp32") == pytest.approx(10**7.5 / 1e10)
    assert p.matmul_seconds(1e3, "fp32") == pytest.approx(1e3 / 1e9)  # below the table: the first rate
    assert p.matmul_seconds(1e12, "fp32") == pytest.approx(1e12 / 1e11)
    assert p.matmul_seconds(1e9, "bf16") == p.matmul_seconds(1e9, "fp32")  # no bf16 row: fp32's
    assert p.matmul_seconds(0, "fp32") == 0.0


def test_collectives_cost_what_a_ring_costs_on_the_link_of_their_group():
    p = _profile()
    b, n = 8e6, 4
    intra, inter = p.intra_node, p.inter_node
    assert p.collective_seconds("all_reduce", b, n) == pytest.approx(
        2 * (n - 1) * (intra.latency + b / n / intra.bandwidth)
    )
    assert p.collective_seconds("all_gather", b, n) == pytest.approx(
        (n - 1) * (intra.latency + b / n / intra.bandwidth)
    )
    assert p.collective_seconds("reduce_scatter", b, n) == p.collective_seconds("all_to_all", b, n)
    assert p.collective_seconds("send", b, 2) == pytest.approx(intra.latency + b / intra.bandwidth)
    assert p.collective_seconds("all_reduce", b, n, across_nodes=True) == pytest.approx(
        2 * (n - 1) * (inter.latency + b / n / inter.bandwidth)
    )
    assert p.collective_seconds("all_reduce", b, 1) == 0.0
    with pytest.raises(ValueError, match=r"collective kind 'broadcast' is unknown; choose one of"):
        p.collective_seconds("broadcast", b, n)


def test_measured_links_win_by_the_nearest_group_size_and_crowding():
    slow, fast = Link(1e8, 1e-3), Link(1e9, 1e-4)
    p = _profile(collectives={(2, 2): fast, (2, 4): slow, (4, 4): slow})
    assert p.link(2, False) is fast
    assert p.link(2, False, ranks_on_node=4) is slow
    assert p.link(3, False, ranks_on_node=4) is slow
    assert p.link(2, True) is p.inter_node


def test_a_group_leaves_its_node_when_its_ranks_span_more_than_a_node():
    assert not spans_nodes(8, 1, 8)
    assert spans_nodes(2, 8, 8)  # two data-parallel ranks 8 apart: two nodes
    assert not spans_nodes(4, 2, 8)
    assert not spans_nodes(1, 64, 8)


def test_a_profile_survives_json_and_the_shipped_ones_load_by_name():
    p = _profile(collectives={(2, 4): Link(1e8, 1e-3)}, overlap=False)
    assert MachineProfile.from_json(p.to_json()) == p
    for name in ("h100-sxm-node", "h200-sxm-node"):
        shipped = MachineProfile.load(name)
        assert shipped.device == "cuda" and shipped.devices_per_node == 8
        assert shipped.matmul_seconds(2 * 8192**3, "bf16") < shipped.matmul_seconds(2 * 8192**3, "fp32")
        assert "datasheet" in shipped.source and "Assumed" in shipped.source
    assert MachineProfile.load("h200-sxm-node").memory_bandwidth > MachineProfile.load("h100-sxm-node").memory_bandwidth
    with pytest.raises(ValueError, match=r"'a100' is neither a file nor a shipped profile \(h100-sxm-node, h200-sxm"):
        MachineProfile.load("a100")


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_a_pipeline_takes_m_plus_p_minus_one_rounds_under_1f1b_and_gpipe(schedule):
    f, b = 1.0, 2.0
    for p, m in ((2, 4), (4, 8), (4, 2)):
        assert pipeline_seconds(schedule, p, m, f, b) == pytest.approx((m + p - 1) * (f + b))
    assert pipeline_seconds(schedule, 1, 5, f, b) == 5 * (f + b)


def test_interleaving_and_zero_bubble_shrink_the_bubble_and_a_costlier_weight_pass_lengthens_it():
    p, m, f, b = 4, 8, 1.0, 2.0
    one_f_one_b = pipeline_seconds("1f1b", p, m, f, b)
    # two chunks per stage, each half the work: (m + (p - 1) / v) rounds of the stage's work
    assert pipeline_seconds("interleaved_1f1b", p, m, f / 2, b / 2, 2) == pytest.approx((m + (p - 1) / 2) * (f + b))
    zero_bubble = pipeline_seconds("zb_h1", p, m, f, b)
    assert zero_bubble < one_f_one_b
    assert pipeline_seconds("zb_h1", p, m, f, b, split=(0.5, 1.0)) > zero_bubble
    assert math.isclose(pipeline_seconds("zb_h1", 1, m, f, b), m * (f + b))
    # ZB-V: two chunks in a V, each half the work, F = I = W per chunk: idle only while the pipe fills
    v_shape = pipeline_seconds("zb_v", p, m, f / 2, b / 2, 2)
    assert v_shape == pytest.approx((6 * m + p - 1) * f / 2) and v_shape < zero_bubble
    assert math.isclose(pipeline_seconds("zb_v", 1, m, f / 2, b / 2, 2), m * (f + b))


@pytest.mark.slow
def test_the_profile_command_measures_this_machine(tmp_path):
    out = tmp_path / "cpu.json"
    assert profile_main(["profile", "--out", str(out), "--group-sizes", "2"]) == 0
    p = MachineProfile.load(out)
    assert p.name == "cpu" and p.device == "cpu" and not p.overlap
    assert set(p.matmul) == {"fp32", "bf16"} and all(rate > 0 for _, rate in p.matmul["fp32"])
    assert p.memory_bandwidth > 0 and 0 < p.operator_overhead < 1e-3
    assert set(p.collectives) == {(2, 2)} and p.collectives[(2, 2)].bandwidth > 0
    assert "measured by `python -m scaling.trainer.planning profile`" in json.loads(out.read_text())["source"]


def test_the_profile_command_names_a_bad_group_size(capsys):
    with pytest.raises(SystemExit):
        profile_main(["profile", "--out", "x.json", "--group-sizes", "1,4"])
    assert "--group-sizes='1,4': each group size must be >= 2" in capsys.readouterr().err
