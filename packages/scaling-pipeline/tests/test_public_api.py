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
            "LossBackward",
            "LossFunction",
            "ParallelModule",
            "PhaseMark",
            "PipelineStage",
            "RecvActivation",
            "RecvGrad",
            "ScheduleError",
            "SendActivation",
            "SendGrad",
            "SimulationResult",
            "StageExecutor",
            "StageOutputs",
            "StageTransports",
            "TiedGroups",
            "count_parameters",
            "forward_only_schedule",
            "gpipe_schedule",
            "interleaved_1f1b_schedule",
            "one_f_one_b_schedule",
            "partition_layers",
            "placement_of",
            "render_program_grid",
            "simulate",
            "simulate_schedule",
            "stage_of",
            "virtual_stage",
            "zb_h1_schedule",
            "zb_v_schedule",
        ]
    )
    assert sorted(scaling.pipeline.schedules.__all__) == [
        "SCHEDULES",
        "forward_only_schedule",
        "gpipe_schedule",
        "interleaved_1f1b_schedule",
        "one_f_one_b_schedule",
        "zb_h1_schedule",
        "zb_v_schedule",
    ]
    for name in scaling.pipeline.__all__:
        assert hasattr(scaling.pipeline, name), name


def test_the_pipeline_runs_schedules_and_nothing_around_them() -> None:
    # The step (update, loss scaling, batch sync, metric aggregation) is scaling.trainer's.
    import pathlib
    import re

    root = pathlib.Path(scaling.pipeline.__file__).parent
    words = re.compile(r"optimi[sz]er|loss_scaler|LossScaler|sync_batch|aggregat", re.IGNORECASE)
    found = [
        f"{path.relative_to(root)}:{n}: {line.strip()}"
        for path in sorted(root.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if words.search(line)
    ]
    assert not found, "\n".join(found)
