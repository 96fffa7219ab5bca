"""MLPConfig: the package configs composed, plus the MLP's own sections."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from scaling.config import BaseConfig
from scaling.nn import CompileConfig, check_compile_layout
from scaling.runner import LaunchedConfig
from scaling.trainer import TrainingAppConfig

TRAIN_SCRIPT = Path(__file__).resolve().with_name("train.py")


class MLPArchitectureConfig(BaseConfig):
    hidden_size: int = Field(256, ge=1, description="Width of the hidden layers; divisible by model_parallel_size.")
    num_blocks: int = Field(
        2, ge=1, description="Column/row-parallel layer pairs; the model has 2 * num_blocks pipeline layers."
    )
    num_classes: int = Field(10, ge=2, description="Output classes.")


class MLPTrainingConfig(BaseConfig):
    weight_decay: float = Field(0.0001, ge=0.0, description="Weight decay of every parameter, >= 0.")
    static_shapes: bool = Field(
        False,
        description="Activation shapes are the same for every micro-batch (Megatron-LM's default): pipeline hand-offs then carry no header after the first; a changed shape raises on the sending stage. False = shapes may vary.",
    )
    compile: CompileConfig = Field(
        default_factory=CompileConfig, description="torch.compile each layer (regional compilation)."
    )


class MLPDataConfig(BaseConfig):
    mnist_path: Path | None = Field(
        None,
        description="Folder with MNIST IDX files (train-images-idx3-ubyte, ...); None = scikit-learn's bundled digits.",
    )
    plot: bool = Field(True, description="Write a loss/accuracy PNG next to the metrics when training ends.")


class MLPConfig(TrainingAppConfig, LaunchedConfig):
    """The whole MLP app config; `python -m scaling.mlp --template` prints it commented."""

    default_script = TRAIN_SCRIPT

    training: MLPTrainingConfig = Field(default_factory=MLPTrainingConfig, description="MLP training settings.")
    architecture: MLPArchitectureConfig = Field(default_factory=MLPArchitectureConfig, description="MLP shape.")
    data: MLPDataConfig = Field(default_factory=MLPDataConfig, description="Training and evaluation data.")

    @model_validator(mode="after")
    def _check_layout(self) -> MLPConfig:
        tp, pp = self.topology.model_parallel_size, self.topology.pipe_parallel_size
        arch = self.architecture
        if arch.hidden_size % tp:  # type: ignore[operator]
            choices = [d for d in range(1, arch.hidden_size + 1) if arch.hidden_size % d == 0 and d <= 64]
            raise ValueError(
                f"architecture.hidden_size={arch.hidden_size} is not divisible by topology.model_parallel_size={tp}; "
                f"choose a model_parallel_size in {choices} or another hidden_size"
            )
        if self.topology.context_parallel_size > 1:
            raise ValueError(
                f"topology.context_parallel_size={self.topology.context_parallel_size}: the MLP's samples have no "
                "sequence to split; set context_parallel_size=1 (context parallelism is for sequence models such "
                "as the transformer app)"
            )
        if 2 * arch.num_blocks < pp:  # type: ignore[operator]
            raise ValueError(
                f"topology.pipe_parallel_size={pp} exceeds the model's {2 * arch.num_blocks} layers "
                f"(architecture.num_blocks={arch.num_blocks}); use at most {2 * arch.num_blocks} stages"
            )
        tp_collectives = [f"topology.model_parallel_size={tp}"] if tp != 1 else []
        check_compile_layout(self.training.compile, "training.compile", collectives=tp_collectives)
        return self
