"""scaling.trainer.planning: what a layout costs each rank, predicted without building the model.

The first part of the planner (#52): model-state bytes per rank (parameters, gradients, master
weights, optimizer state; device and host) for any TP, PP, DP, CP, EP, ZeRO stage, HSDP, precision,
update rule and offload, exactly as the packages allocate them (``_memory.py``; tested against the
storages a step holds); activation bytes of a stage from its in-flight micro-batches
(``_activations.py``), given what the app's planner says one micro-batch holds per model chunk;
seconds per step from a machine's profile (``_time.py``: measured by ``python -m
scaling.trainer.planning profile``, or shipped for H100/H200 nodes) and a schedule's makespan.
"""

from scaling.trainer.planning._activations import in_flight_peak
from scaling.trainer.planning._memory import (
    MemoryLayout,
    ParameterSpec,
    RankMemory,
    parameter_specs,
    peak_rank_memory,
    rank_memory,
)
from scaling.trainer.planning._profile import measure_profile
from scaling.trainer.planning._time import Link, MachineProfile, pipeline_seconds, spans_nodes

__all__ = [
    "Link",
    "MachineProfile",
    "MemoryLayout",
    "ParameterSpec",
    "RankMemory",
    "in_flight_peak",
    "measure_profile",
    "parameter_specs",
    "peak_rank_memory",
    "pipeline_seconds",
    "rank_memory",
    "spans_nodes",
]
