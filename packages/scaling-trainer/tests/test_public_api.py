import scaling.trainer
import scaling.trainer.auto


def test_public_api():
    assert sorted(scaling.trainer.__all__) == [
        "BaseContext",
        "BaseTrainer",
        "CheckpointError",
        "HANDLED_SIGNALS",
        "LoadedCheckpoint",
        "LoggerConfig",
        "MetricsLogger",
        "PendingSave",
        "ProfilerConfig",
        "StepProfiler",
        "TrainerConfig",
        "committed_steps",
        "exit_code_for",
        "load_checkpoint",
        "load_model_state_dict",
        "logger",
        "model_state_dict",
        "new_checkpoint_group",
        "save_checkpoint",
    ]


def test_auto_public_api():
    assert sorted(scaling.trainer.auto.__all__) == [
        "CONSTRAINT_KEYS",
        "ModuleSharding",
        "ParallelModel",
        "ParallelOptimizer",
        "Plan",
        "deferred_init",
        "generate_plan",
        "is_deferred",
        "load",
        "materialize",
        "parallelize",
        "save",
    ]
