"""Comparing two recorded runs step by step, and naming the first thing that diverges."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from scaling.trainer.numerics._record import OUTPUT, Stats, StepTrace, Trace


@dataclass(frozen=True)
class Tolerance:
    """How far two runs may differ at one precision, as relative errors.

    Attributes:
        activation: of a module's global sums (``‖x‖₂``, ``‖x‖₁``, ``max |x|``), outputs and input
            gradients alike: ``|a − b| / max(|a|, |b|)``.
        gradient: of a whole parameter gradient: ``‖a − b‖₂ / max(‖a‖₂, ‖b‖₂)``.
        update: of a whole parameter update, as the gradient (Adam divides by the gradient's
            own scale, so an element whose gradient is near zero moves by ``±lr`` on a rounding).
    """

    activation: float
    gradient: float
    update: float


#: By the less precise of the two runs; measured on the transformer app (2 steps, hidden 32), the
#: largest errors of correct layouts and precisions, with the margin over them:
#: float32 layouts 6e-7 (activations), 5e-6 (gradients), 5e-5 (updates): margins 15-20x.
#: bfloat16 (layouts at bf16, and bf16 against fp32) 1.6e-2, 2.6e-2, 0.33; float8 (layouts at
#: float8, and float8 against bf16) 0.10, 0.10, 0.50: margins 2-4x. In low precision the rounding
#: of each layout's partial sums is as large as a precision change, and Adam's first updates move
#: an element whose gradient is near zero by ±lr on a rounding: there the update check catches
#: gross errors only (a sign, a missing update), the outputs and gradients the rest.
TOLERANCES: dict[str, Tolerance] = {
    "float32": Tolerance(activation=1e-4, gradient=5e-4, update=5e-3),
    "float16": Tolerance(activation=5e-2, gradient=2e-1, update=7.5e-1),
    "bfloat16": Tolerance(activation=5e-2, gradient=2e-1, update=7.5e-1),
    "float8": Tolerance(activation=2.5e-1, gradient=4e-1, update=1.0),
}
_RANK = {"float32": 0, "float16": 1, "bfloat16": 2, "float8": 3}
_TINY = 1e-30


def tolerance_for(a: str, b: str) -> Tolerance:
    """The tolerance of the less precise of precisions ``a`` and ``b``."""
    for p in (a, b):
        if p not in TOLERANCES:
            raise ValueError(f"precision {p!r} has no tolerance; known: {', '.join(TOLERANCES)}")
    return TOLERANCES[max(a, b, key=_RANK.__getitem__)]


@dataclass(frozen=True)
class Divergence:
    """The first quantity two runs disagree on: ``step`` (from 1), ``quantity`` (``output``,
    ``input gradient``, ``gradient`` or ``update``), the module or parameter ``name``, the
    relative ``error`` against ``tolerance``, the values, and the collectives that fed it in each run
    (``collectives_a``, ``collectives_b``: ``"op on group" -> calls``; for an input gradient, those
    since the previous backward event)."""

    step: int
    quantity: str
    name: str
    error: float
    tolerance: float
    detail: str
    collectives_a: dict[str, int] = field(default_factory=dict)
    collectives_b: dict[str, int] = field(default_factory=dict)

    def describe(self) -> str:
        def fed(calls: dict[str, int]) -> str:
            return ", ".join(f"{op} ×{n}" for op, n in sorted(calls.items())) or "none"

        return (
            f"first divergence: step {self.step}, {self.quantity} of {self.name}: relative error "
            f"{self.error:.3e} > {self.tolerance:.1e}\n  {self.detail}\n"
            f"  collectives that fed it: a: {fed(self.collectives_a)}; b: {fed(self.collectives_b)}"
        )


@dataclass
class NumericsReport:
    """The comparison of run ``a`` with run ``b``: the first :class:`Divergence` (None when every
    quantity agrees), the losses per step, how many quantities were compared and the names
    only one run recorded (not compared)."""

    a: str
    b: str
    tolerance: Tolerance
    first: Divergence | None
    losses: list[tuple[float, float]]
    compared: int
    only_in_one: list[str]
    #: quantity -> (relative error, name, step) of the largest error seen up to the divergence
    worst: dict[str, tuple[float, str, int]] = field(default_factory=dict)

    def describe(self) -> str:
        lines = [f"a: {self.a}", f"b: {self.b}", f"tolerance: {self.tolerance}"]
        lines += [f"step {i}: loss a {la:.8g}, b {lb:.8g}" for i, (la, lb) in enumerate(self.losses, 1)]
        if self.only_in_one:
            lines.append(f"recorded by one run only (not compared): {', '.join(self.only_in_one[:8])}")
        for quantity, (error, name, step) in self.worst.items():
            lines.append(f"largest {quantity} error: {error:.2e} ({name}, step {step})")
        lines.append(
            self.first.describe() if self.first else f"no divergence: {self.compared} quantities within tolerance"
        )
        return "\n".join(lines)


def _relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), _TINY)


def _compare_stats(a: Stats, b: Stats) -> tuple[float, str]:
    """The sums, or the means where one run holds a whole multiple of the other's elements: a tensor
    that does not depend on the batch yet has a batch dimension (a rotary table given per-sample
    positions under context parallelism) is that many copies. A count off by a fraction is padding
    (a vocabulary padded for TP), which adds nothing to the sums."""
    ratio = max(a.elements, b.elements) / max(min(a.elements, b.elements), 1.0)
    means = a.elements > 0 and b.elements > 0 and ratio > 1 and ratio == round(ratio)
    labels = ("‖x‖₂", "‖x‖₁", "max |x|")
    va, vb = list(a[:3]), list(b[:3])
    if means:
        labels = ("rms", "mean |x|", "max |x|")
        va = [a.l2 / a.elements**0.5, a.l1 / a.elements, a.max_abs]
        vb = [b.l2 / b.elements**0.5, b.l1 / b.elements, b.max_abs]
    errors = [_relative(x, y) for x, y in zip(va, vb)]
    worst = max(range(3), key=errors.__getitem__)
    return errors[worst], f"{labels[worst]}: a {va[worst]:.8g}, b {vb[worst]:.8g}"


def _compare_tensors(a: torch.Tensor, b: torch.Tensor) -> tuple[float, str]:
    if a.shape != b.shape:
        return float("inf"), f"shapes differ: a {list(a.shape)}, b {list(b.shape)}"
    a64, b64 = a.double(), b.double()
    diff = a64 - b64
    error = float(diff.norm()) / max(float(a64.norm()), float(b64.norm()), _TINY)
    if diff.numel() == 0:
        return 0.0, "empty"
    i = int(diff.abs().argmax())
    idx = tuple(int(x) for x in torch.unravel_index(torch.tensor(i), diff.shape))
    return error, (
        f"‖a‖₂ {float(a64.norm()):.8g}, ‖b‖₂ {float(b64.norm()):.8g}, largest difference at {list(idx)}: "
        f"a {float(a64.flatten()[i]):.8g}, b {float(b64.flatten()[i]):.8g}"
    )


_Item = tuple[str, str, object, object, dict[str, int], dict[str, int]]


def _step_items(sa: StepTrace, sb: StepTrace) -> list[_Item]:
    """The step's quantities in execution order: outputs (forward), the loss, input gradients (backward),
    parameter gradients (last layer first, as backward produces them), updates (first layer first)."""
    items: list[_Item] = []
    for key in sa.activations:
        if key in sb.activations:
            va, vb = sa.activations[key], sb.activations[key]
            items.append((key[0], key[1], va, vb, sa.collectives.get(key, {}), sb.collectives.get(key, {})))
    forward = [i for i in items if i[0] == OUTPUT]
    backward = [i for i in items if i[0] != OUTPUT]
    # A parameter's place: its module's in the forward (an expert's, its MoE layer's).
    modules = {name.split("/")[0].split("#")[0]: i for i, (_, name, *_) in reversed(list(enumerate(forward)))}

    def place(key: str) -> int:
        module = key
        while module not in modules and "." in module:
            module = module.rsplit(".", 1)[0]
        return modules.get(module, len(modules))

    grads = sorted((k for k in sa.gradients if k in sb.gradients), key=lambda k: -place(k))
    updates = sorted((k for k in sa.updates if k in sb.updates), key=place)
    return (
        forward
        + [(OUTPUT, "loss", sa.loss, sb.loss, {}, {})]
        + backward
        + [("gradient", k, sa.gradients[k], sb.gradients[k], {}, {}) for k in grads]
        + [("update", k, sa.updates[k], sb.updates[k], {}, {}) for k in updates]
    )


def compare(a: Trace, b: Trace, tolerance: Tolerance | None = None) -> NumericsReport:
    """Compare trace ``a`` with trace ``b`` step by step; the first quantity out of tolerance
    (default: :func:`tolerance_for` their precisions) is the report's ``first``."""
    tol = tolerance or tolerance_for(a.precision, b.precision)
    limits = {"gradient": tol.gradient, "update": tol.update}
    compared, first = 0, None
    worst: dict[str, tuple[float, str, int]] = {}
    only: set[str] = set()
    for step, (sa, sb) in enumerate(zip(a.steps, b.steps), 1):
        only |= {n for _, n in sa.activations.keys() ^ sb.activations.keys()}
        only |= sa.gradients.keys() ^ sb.gradients.keys()
        for quantity, name, va, vb, fed_a, fed_b in _step_items(sa, sb):
            if isinstance(va, float) and isinstance(vb, float):
                error, detail = _relative(va, vb), f"a {va:.8g}, b {vb:.8g}"
            elif isinstance(va, Stats) and isinstance(vb, Stats):
                error, detail = _compare_stats(va, vb)
            else:
                assert isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)
                error, detail = _compare_tensors(va, vb)
            compared += 1
            if error > worst.get(quantity, (-1.0,))[0]:
                worst[quantity] = (error, name, step)
            limit = limits.get(quantity, tol.activation)
            if first is None and not error <= limit:
                first = Divergence(step, quantity, name, error, limit, detail, fed_a, fed_b)
        if first is not None:
            break
    losses = [(sa.loss, sb.loss) for sa, sb in zip(a.steps, b.steps)]
    return NumericsReport(
        f"{a.layout} ({a.precision})", f"{b.layout} ({b.precision})", tol, first, losses, compared, sorted(only), worst
    )
