"""compare(): the first divergence in execution order, against the tolerance of the less precise run."""

from __future__ import annotations

import pytest
import torch

from scaling.trainer.numerics import TOLERANCES, Stats, StepTrace, Trace, compare, tolerance_for


def _step(loss=1.0, out=1.0, grad_in=1.0, grads=None, updates=None) -> StepTrace:
    acts = {
        ("output", "layers.0"): Stats(out, out, out),
        ("output", "layers.1"): Stats(1.0, 1.0, 1.0),
        ("input gradient", "layers.1"): Stats(grad_in, grad_in, grad_in),
        ("input gradient", "layers.0"): Stats(1.0, 1.0, 1.0),
    }
    grads = grads or {"layers.0.w": torch.ones(3), "layers.1.w": torch.ones(3)}
    updates = updates or {"layers.0.w": torch.ones(3), "layers.1.w": torch.ones(3)}
    return StepTrace(loss, acts, {k: {"all_reduce on tp": 1} for k in acts}, grads, updates)


def _trace(*steps: StepTrace, precision: str = "float32") -> Trace:
    return Trace(precision, "test", list(steps))


def test_identical_runs_agree_and_every_quantity_is_counted():
    report = compare(_trace(_step(), _step()), _trace(_step(), _step()))
    assert report.first is None and report.compared == 2 * (4 + 1 + 2 + 2)
    assert "no divergence: 18 quantities" in report.describe()


def test_the_first_divergence_is_the_earliest_in_execution_order():
    # step 2 diverges in an output and, later in that step, in a gradient: the output is named
    a = _trace(_step(), _step())
    b = _trace(_step(), _step(out=1.1, grads={"layers.0.w": torch.ones(3), "layers.1.w": 2 * torch.ones(3)}))
    first = compare(a, b).first
    assert first is not None and (first.step, first.quantity, first.name) == (2, "output", "layers.0")
    assert first.collectives_a == first.collectives_b == {"all_reduce on tp": 1}
    assert "step 2, output of layers.0" in first.describe()
    assert "collectives that fed it: a: all_reduce on tp ×1; b: all_reduce on tp ×1" in first.describe()


@pytest.mark.parametrize(
    ("changed", "quantity", "name"),
    [
        (dict(loss=1.01), "output", "loss"),
        (dict(grad_in=0.9), "input gradient", "layers.1"),
        # gradients last layer first (backward's order), updates first layer first
        (dict(grads={"layers.0.w": 2 * torch.ones(3), "layers.1.w": 2 * torch.ones(3)}), "gradient", "layers.1.w"),
        (dict(updates={"layers.0.w": -torch.ones(3), "layers.1.w": -torch.ones(3)}), "update", "layers.0.w"),
    ],
)
def test_each_quantity_is_checked_in_its_place(changed, quantity, name):
    first = compare(_trace(_step()), _trace(_step(**changed))).first
    assert first is not None and (first.quantity, first.name) == (quantity, name)


def test_the_tolerance_is_the_less_precise_run_s():
    assert tolerance_for("float32", "bfloat16") == TOLERANCES["bfloat16"] == tolerance_for("bfloat16", "float32")
    assert tolerance_for("bfloat16", "float8") == TOLERANCES["float8"]
    # 1 % in an output: a float32 comparison names it, a bf16 one does not
    assert compare(_trace(_step()), _trace(_step(out=1.01))).first is not None
    assert compare(_trace(_step()), _trace(_step(out=1.01), precision="bfloat16")).first is None
    with pytest.raises(ValueError, match="precision 'int4' has no tolerance; known: float32"):
        tolerance_for("int4", "float32")


def test_names_recorded_by_one_run_only_are_listed_not_compared():
    b = _step()
    b.gradients["layers.9.extra"] = torch.ones(1)
    report = compare(_trace(_step()), _trace(b))
    assert report.first is None and report.only_in_one == ["layers.9.extra"]


def test_a_trace_round_trips_through_a_file(tmp_path):
    step = StepTrace(1.5, {("output", "layers.0"): Stats(1.0, 2.0, 0.5)}, {("output", "layers.0"): {"op": 1}},
                     {"layers.0.w": torch.ones(2)}, {"layers.0.w": torch.zeros(2)})  # fmt: skip
    Trace("float32", "dp2", [step]).save(str(tmp_path / "t.pt"))
    back = Trace.load(str(tmp_path / "t.pt"))
    assert back.steps[0].activations == step.activations and back.layout == "dp2"
    assert compare(back, back).first is None


class _Payload:
    def __reduce__(self):
        return (print, ("code ran",))


def test_a_trace_file_cannot_run_code(tmp_path):
    torch.save({"precision": "float32", "layout": "x", "steps": [_Payload()]}, tmp_path / "evil.pt")
    with pytest.raises(Exception, match="Weights only load failed"):
        Trace.load(str(tmp_path / "evil.pt"))
