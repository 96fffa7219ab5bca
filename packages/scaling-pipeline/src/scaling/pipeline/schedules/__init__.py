"""Pipeline schedules: pure functions ``(num_stages, num_micro_batches, stage[, num_virtual])``."""

from collections.abc import Callable

from scaling.pipeline._instructions import Instruction
from scaling.pipeline.schedules.forward_only import forward_only_schedule
from scaling.pipeline.schedules.gpipe import gpipe_schedule
from scaling.pipeline.schedules.interleaved import interleaved_1f1b_schedule
from scaling.pipeline.schedules.one_f_one_b import one_f_one_b_schedule
from scaling.pipeline.schedules.zero_bubble import zb_h1_schedule
from scaling.pipeline.schedules.zero_bubble_v import zb_v_schedule

#: Training schedules by name (``ParallelModule(schedule=...)``).
SCHEDULES: dict[str, Callable[..., list[Instruction]]] = {
    "gpipe": gpipe_schedule,
    "1f1b": one_f_one_b_schedule,
    "interleaved_1f1b": interleaved_1f1b_schedule,
    "zb_h1": zb_h1_schedule,
    "zb_v": zb_v_schedule,
}

__all__ = [
    "SCHEDULES",
    "forward_only_schedule",
    "gpipe_schedule",
    "interleaved_1f1b_schedule",
    "one_f_one_b_schedule",
    "zb_h1_schedule",
    "zb_v_schedule",
]
