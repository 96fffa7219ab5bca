import scaling.pipeline
import scaling.pipeline.schedules


def test_public_api_is_pinned() -> None:
    assert sorted(scaling.pipeline.__all__) == sorted(
        [
            "DEFAULT_COSTS",
            "PARTITION_METHODS",
            "SCHEDULES",
            "Backward",
            "BackwardInput",
            "BackwardWeight",
            "Exchange",
            "Forward",
            "Instruction",
            "LoadMicroBatch",
            "OptimizerLike",
            "OptimizerStep",
            "ParallelModule",
            "RecvActivation",
            "RecvGrad",
            "ReduceTiedGrads",
            "ScheduleError",
            "SendActivation",
            "SendGrad",
            "SimulationResult",
            "StageExecutor",
            "TrainStepOutput",
            "count_parameters",
            "forward_only_schedule",
            "gpipe_schedule",
            "interleaved_1f1b_schedule",
            "one_f_one_b_schedule",
            "partition_layers",
            "render_program_grid",
            "simulate",
            "simulate_schedule",
            "zb_h1_schedule",
        ]
    )
    assert sorted(scaling.pipeline.schedules.__all__) == [
        "forward_only_schedule",
        "gpipe_schedule",
        "interleaved_1f1b_schedule",
        "one_f_one_b_schedule",
        "zb_h1_schedule",
    ]
    for name in scaling.pipeline.__all__:
        assert hasattr(scaling.pipeline, name), name
