"""TrainingAppConfig: the sections every training app's config has."""

from __future__ import annotations

from pydantic import Field, model_validator

from scaling.config import BaseConfig
from scaling.optim import LearningRateSchedulerConfig, OptimizerConfig, check_sharding
from scaling.topology import TopologyConfig
from scaling.trainer._config import TrainerConfig
from scaling.trainer._profiler import ProfilerConfig
from scaling.trainer.loggers import LoggerConfig


class TrainingAppConfig(BaseConfig):
    """Base of a training app's config: the package sections a :class:`BaseTrainer` run reads.

    ``logger``, ``topology``, ``optimizer``, ``learning_rate_scheduler``, ``trainer`` and
    ``profiler`` (read by :class:`BaseTrainer` from the context's config), and
    the one check they need together (the optimizer's sharding fits the topology). An app
    adds its own sections (architecture, data, ...) and validators::

        class MyConfig(TrainingAppConfig):
            architecture: MyArchitectureConfig = Field(default_factory=MyArchitectureConfig)
    """

    logger: LoggerConfig = Field(default_factory=LoggerConfig, description="Where metrics go.")
    topology: TopologyConfig = Field(description="Parallel layout and batch sizes.")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, description="Update rule, ZeRO, clipping.")
    learning_rate_scheduler: LearningRateSchedulerConfig = Field(
        default_factory=LearningRateSchedulerConfig, description="Learning rate schedule of every parameter."
    )
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="Iterations, evaluation, checkpoints.")
    profiler: ProfilerConfig = Field(
        default_factory=ProfilerConfig, description="Steps to profile with torch.profiler; CUDA memory snapshots."
    )

    @model_validator(mode="after")
    def _check_sharding(self) -> TrainingAppConfig:
        check_sharding(self.optimizer, self.topology)
        return self

    def describe_launch(self) -> str:
        """One line of what a launch of this config runs, e.g. ``8 ranks (tp 2 x pp 2 x dp 2),
        300 steps; metrics in runs/mlp, checkpoints in runs/mlp/checkpoints`` (the apps print it first)."""
        t = self.topology
        sizes = [
            ("tp", t.model_parallel_size),
            ("pp", t.pipe_parallel_size),
            ("cp", t.context_parallel_size),
            ("dp", t.data_parallel_size),
        ]
        layout = " x ".join(f"{name} {size}" for name, size in sizes if size and size > 1) or "one process"
        if t.expert_parallel_size > 1:  # experts split over groups of DP ranks: no ranks of its own
            layout += f", experts over ep {t.expert_parallel_size} of dp"
        where = [f"metrics in {self.logger.log_dir}"] if self.logger.log_dir is not None else []
        if self.trainer.save_dir is not None:
            where.append(f"checkpoints in {self.trainer.save_dir}")
        steps = f"{self.trainer.train_iterations} steps"
        return f"{t.world_size} rank(s) ({layout}), {steps}" + (f"; {', '.join(where)}" if where else "")
