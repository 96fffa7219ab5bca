"""scaling.trainer.numerics: the numerics bisector.

Run the same global batch for a few steps under two settings (two layouts, or two
precisions), record per module the forward outputs and input gradients, and per parameter
the reduced gradient and the update, in the layout-independent frame
(:class:`NumericsRecorder`), then name the first quantity, in execution order, where the
runs differ beyond a dtype-aware tolerance (:func:`compare`). ``scaling-check numerics``
does both for an app's config from the command line.
"""

from scaling.trainer.numerics._compare import (
    TOLERANCES,
    Divergence,
    NumericsReport,
    Tolerance,
    compare,
    tolerance_for,
)
from scaling.trainer.numerics._record import NumericsRecorder, Stats, StepTrace, Trace, precision_of

__all__ = [
    "TOLERANCES",
    "Divergence",
    "NumericsRecorder",
    "NumericsReport",
    "Stats",
    "StepTrace",
    "Tolerance",
    "Trace",
    "compare",
    "precision_of",
    "tolerance_for",
]
