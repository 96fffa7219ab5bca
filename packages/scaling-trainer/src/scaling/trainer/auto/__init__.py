"""scaling.trainer.auto: the automatic way in (deferred_init, generate_plan, parallelize, save, load, full_state_dict)."""

from scaling.trainer.auto._checkpoint import full_state_dict, load, save
from scaling.trainer.auto._deferred import deferred_init, is_deferred, materialize
from scaling.trainer.auto._generate import CONSTRAINT_KEYS, generate_plan
from scaling.trainer.auto._optimizer import ParallelOptimizer
from scaling.trainer.auto._parallelize import ParallelModel, parallelize
from scaling.trainer.auto._plan import ModuleSharding, Plan

__all__ = [
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
