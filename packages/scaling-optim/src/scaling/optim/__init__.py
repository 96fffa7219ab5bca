"""scaling.optim: optimizer (AdamW, Adam, SGD, Muon), parameter groups, mixed precision, loss scaling, ZeRO, LR schedules."""

from scaling.optim._config import (
    LearningRateSchedulerConfig,
    LossScalerConfig,
    MuonConfig,
    OptimizerConfig,
    OptimizerParamGroupConfig,
)
from scaling.optim._data_parallel import DataParallel
from scaling.optim._loss_scaler import LossScaler
from scaling.optim._lr_scheduler import LearningRateScheduler
from scaling.optim._optimizer import Optimizer
from scaling.optim._param_group import OptimizerParamGroup, build_parameter_groups
from scaling.optim._reducer import GradientReducer
from scaling.optim._spaces import ShardSpace
from scaling.optim._step_output import OptimizerStepOutput
from scaling.optim._update import state_names, update_rule
from scaling.optim._zero3 import check_sharding

__all__ = [
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
