import scaling.topology


def test_public_api():
    assert sorted(scaling.topology.__all__) == [
        "AXIS_NAMES",
        "Axis",
        "MESH_DIM_NAMES",
        "MODEL_PARALLEL_RNG",
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
