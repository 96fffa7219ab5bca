import inspect

import scaling.optim
from scaling.optim import Optimizer, OptimizerStepOutput


def test_public_api():
    assert sorted(scaling.optim.__all__) == [
        "DataParallel",
        "GradientReducer",
        "LearningRateScheduler",
        "LearningRateSchedulerConfig",
        "LossScaler",
        "LossScalerConfig",
        "MuonConfig",
        "Optimizer",
        "OptimizerConfig",
        "OptimizerParamGroup",
        "OptimizerParamGroupConfig",
        "OptimizerStepOutput",
        "ShardSpace",
        "build_parameter_groups",
        "check_sharding",
        "state_names",
        "update_rule",
    ]


def test_call_shapes_others_code_against():
    assert list(inspect.signature(Optimizer).parameters) == [
        "config",
        "parameter_groups",
        "topology",
        "zero3_modules",
        "model",
    ]
    assert list(inspect.signature(scaling.optim.OptimizerParamGroup).parameters) == [
        "named_parameters_with_meta",
        "config",
    ]
    for method in (
        "zero_grad",
        "backward",
        "step",
        "state_dict",
        "load_state_dict",
        "full_parameters",
        "finish_gradient_reduction",
        "finish_parameter_gather",
        "attach_model",
        "sync_from_parameters",
    ):
        assert callable(getattr(Optimizer, method))
    assert [f for f in OptimizerStepOutput.__dataclass_fields__] == [
        "global_grad_norm",
        "global_grad_norm_clipped",
        "learning_rates",
        "overflow",
        "skipped",
        "no_overflow_steps",
        "current_loss_scale",
        "step",
    ]
