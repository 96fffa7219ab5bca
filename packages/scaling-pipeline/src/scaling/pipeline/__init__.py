"""scaling.pipeline: ParallelModule, stage partitioning, schedules as data, simulator, executor."""

from scaling.pipeline._executor import (
    LossBackward,
    LossFunction,
    PhaseMark,
    PipelineStage,
    StageExecutor,
    StageOutputs,
    StageTransports,
)
from scaling.pipeline._instructions import (
    Backward,
    BackwardInput,
    BackwardWeight,
    Exchange,
    Forward,
    Instruction,
    LoadMicroBatch,
    RecvActivation,
    RecvGrad,
    SendActivation,
    SendGrad,
    stage_of,
    virtual_stage,
)
from scaling.pipeline._parallel_module import ParallelModule
from scaling.pipeline._partition import PARTITION_METHODS, count_parameters, partition_layers
from scaling.pipeline._render import render_program_grid
from scaling.pipeline._simulator import DEFAULT_COSTS, ScheduleError, SimulationResult, simulate, simulate_schedule
from scaling.pipeline._tied import TiedGroups
from scaling.pipeline.schedules import (
    SCHEDULES,
    forward_only_schedule,
    gpipe_schedule,
    interleaved_1f1b_schedule,
    one_f_one_b_schedule,
    zb_h1_schedule,
    zb_v_schedule,
)
from scaling.pipeline.schedules._common import placement_of

__all__ = [
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
