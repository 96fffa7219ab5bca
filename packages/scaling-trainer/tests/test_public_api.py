import subprocess
import sys

import pytest

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
        "TrainStepOutput",
        "TrainerConfig",
        "TrainingAppConfig",
        "committed_steps",
        "device_peak_flops",
        "evaluation_step",
        "exit_code_for",
        "load_checkpoint",
        "load_model_state_dict",
        "logger",
        "model_state_dict",
        "new_checkpoint_group",
        "save_checkpoint",
        "train_step",
    ]


def test_auto_public_api():
    assert sorted(scaling.trainer.auto.__all__) == [
        "CONSTRAINT_KEYS",
        "ModuleSharding",
        "ParallelModel",
        "ParallelOptimizer",
        "Plan",
        "deferred_init",
        "full_state_dict",
        "generate_plan",
        "is_deferred",
        "load",
        "materialize",
        "parallelize",
        "save",
    ]


def test_every_exported_name_resolves():
    import scaling.trainer.checkpoint

    for module in (scaling.trainer, scaling.trainer.checkpoint):
        for name in module.__all__:
            assert getattr(module, name) is not None, (module.__name__, name)
    assert scaling.trainer.save_checkpoint is scaling.trainer.checkpoint._save.save_checkpoint
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        scaling.trainer.no_such_name  # noqa: B018


def test_import_leaves_distributed_checkpoint_and_dtensor_until_used():
    # They cost ~0.4 s of CPU (sympy with DTensor) in a process that never saves or loads.
    # sympy itself is not checked: torch 2.6's own import already brings it in.
    code = (
        "import sys, scaling.trainer, scaling.optim\n"
        "heavy = {'torch.distributed.checkpoint', 'torch.distributed.tensor'}\n"
        "assert not heavy & set(sys.modules), heavy & set(sys.modules)\n"
        "scaling.trainer.load_checkpoint\n"
        "assert heavy <= set(sys.modules)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
