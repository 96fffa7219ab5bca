"""scaling.topology: the rank grid, process groups, DeviceMesh and RNG streams."""

from scaling.topology._axes import AXIS_NAMES, Axis, RankCoordinates
from scaling.topology._config import TopologyConfig
from scaling.topology._device import barrier_device_ids
from scaling.topology._flight_recorder import set_flight_recorder_folder
from scaling.topology._rng import (
    MODEL_PARALLEL_RNG,
    RNGTracker,
    get_rng_state,
    seed_all,
    set_rng_state,
    use_deterministic_algorithms,
)
from scaling.topology._sequence import split_sequence, zigzag_indices
from scaling.topology._teardown import destroy_process_group
from scaling.topology._topology import MESH_DIM_NAMES, Topology

__all__ = [
    "AXIS_NAMES",
    "MESH_DIM_NAMES",
    "MODEL_PARALLEL_RNG",
    "Axis",
    "RNGTracker",
    "RankCoordinates",
    "Topology",
    "TopologyConfig",
    "barrier_device_ids",
    "destroy_process_group",
    "get_rng_state",
    "seed_all",
    "set_flight_recorder_folder",
    "set_rng_state",
    "split_sequence",
    "use_deterministic_algorithms",
    "zigzag_indices",
]
