"""The straggler timer on CUDA times phases by events on the current stream (device time, #51).

The host only queues kernels, so host time would put a phase's work wherever the host next
waits; the events put it in the phase that queued it.
"""

import pytest
import torch

from scaling.trainer._stragglers import PHASES, PhaseTimer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none is present on this machine"),
]


def test_phases_get_the_device_time_of_the_kernels_they_queue():
    timer = PhaseTimer(torch.device("cuda"), steps=1)
    timer.start_step()
    timer.mark("forward")
    torch.cuda._sleep(200_000_000)  # a kernel that spins on the device (~0.1 s on an H200)
    timer.mark("optimizer")
    timer.end_step()  # the host is long past the kernel here: host time would give forward ~0
    (row,) = timer.table()
    forward, optimizer = row[PHASES.index("forward")], row[PHASES.index("optimizer")]
    assert forward > 0.01 and forward > 20 * optimizer, row
