"""Configs of the optimizer, its parameter groups, the LR schedule and the loss scaler."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from scaling.config import BaseConfig

MAX_LEARNING_RATE = 10.0  # above it a learning rate is a typo (1e308), refused by the config

OptimizerMethod = Literal["adamw", "adam", "sgd", "muon"]
MuonLearningRateAdjustment = Literal["match_rms_adamw", "original", "none"]
LearningRateDecayStyle = Literal["constant", "linear", "cosine", "inverse_sqrt"]
NonFinitePolicy = Literal["skip", "fail"]


class LearningRateSchedulerConfig(BaseConfig):
    """A learning-rate schedule: warmup delay, linear warmup, then a decay to a minimum.

    Steps are counted in applied optimizer updates starting at 1; steps skipped for a
    non-finite gradient do not advance the schedule. For update ``k``:

    - ``k <= learning_rate_warmup_delay_steps``: LR 0;
    - the next ``learning_rate_warmup_steps`` updates: linear warmup up to ``learning_rate``;
    - then the decay style, reaching ``learning_rate_minimum`` at
      ``learning_rate_decay_iters`` (counted from step 0, delay and warmup included) and
      staying there (``inverse_sqrt`` decays as ``1/sqrt(k)`` and never goes below the minimum).
    """

    learning_rate: float = Field(0.0001, description="Peak learning rate after warmup; 0 to 10.")
    learning_rate_minimum: float = Field(0.0, description="Floor the decay ends at; 0 to learning_rate.")
    learning_rate_decay_style: LearningRateDecayStyle = Field(
        "constant", description="Decay after warmup: 'constant', 'linear', 'cosine' or 'inverse_sqrt'."
    )
    learning_rate_decay_iters: int = Field(
        0,
        ge=0,
        description="Update at which the decay reaches learning_rate_minimum, counted from step 0 including "
        "delay and warmup; ignored for 'constant' and 'inverse_sqrt'.",
    )
    learning_rate_warmup_steps: int = Field(0, ge=0, description="Updates of linear warmup from 0; 0 = no warmup.")
    learning_rate_warmup_delay_steps: int = Field(
        0, ge=0, description="Updates at LR 0 before warmup starts (e.g. to warm up optimizer moments); 0 = none."
    )

    @field_validator("learning_rate", "learning_rate_minimum")
    @classmethod
    def _in_range(cls, value: float, info: ValidationInfo) -> float:
        # After parsing: '1e308' typed on a command line is a string to YAML, a float here.
        name = info.field_name or "learning_rate"
        if value < 0:
            raise ValueError(f"{name}={value} is negative; a learning rate must be >= 0")
        if value > MAX_LEARNING_RATE:
            # Finite but absurd (1e308 is a typo, not a setting): the first update would make the
            # weights non-finite and every later step would skip or fail.
            raise ValueError(
                f"{name}={value} is above {MAX_LEARNING_RATE:g}: no optimizer here trains at that rate (AdamW's "
                "are about 1e-5 to 1e-2, SGD's rarely above 1); lower it"
            )
        return value

    @model_validator(mode="after")
    def _check(self) -> LearningRateSchedulerConfig:
        if self.learning_rate_minimum > self.learning_rate:
            raise ValueError(
                f"learning_rate_minimum={self.learning_rate_minimum} is above learning_rate={self.learning_rate}; "
                "lower learning_rate_minimum"
            )
        if self.learning_rate_decay_style in ("linear", "cosine"):
            ramp = self.learning_rate_warmup_delay_steps + self.learning_rate_warmup_steps
            if ramp >= self.learning_rate_decay_iters:
                raise ValueError(
                    f"learning_rate_warmup_delay_steps={self.learning_rate_warmup_delay_steps} + "
                    f"learning_rate_warmup_steps={self.learning_rate_warmup_steps} = {ramp} is not shorter than "
                    f"learning_rate_decay_iters={self.learning_rate_decay_iters} for decay style "
                    f"'{self.learning_rate_decay_style}'; warmup longer than the schedule: raise "
                    "learning_rate_decay_iters or shorten the warmup"
                )
        return self


class LossScalerConfig(BaseConfig):
    """Dynamic loss scaling (for fp16): scale the loss, skip and shrink on overflow, grow after a window."""

    enable: bool = Field(False, description="Scale the loss dynamically; needed for fp16, optional for bf16.")
    initial_scale: float = Field(2.0**16, gt=0.0, description="Loss scale of the first step; > 0.")
    window: int = Field(1000, ge=1, description="Overflow-free steps after which the scale grows by factor; >= 1.")
    hysteresis: int = Field(
        2, ge=1, description="Overflows tolerated before the scale shrinks (reset on growth); 1 = shrink at once."
    )
    consecutive_hysteresis: bool = Field(
        False, description="Refill the hysteresis budget after every overflow-free step, not only on growth."
    )
    min_scale: float = Field(1.0, gt=0.0, description="The scale never shrinks below this; > 0.")
    factor: float = Field(2.0, gt=1.0, description="Multiplier for growth and divisor for shrinking; > 1.")

    @model_validator(mode="after")
    def _check(self) -> LossScalerConfig:
        if self.min_scale > self.initial_scale:
            raise ValueError(f"min_scale={self.min_scale} is above initial_scale={self.initial_scale}; lower min_scale")
        return self


class OptimizerParamGroupConfig(BaseConfig):
    """Settings of one parameter group."""

    name: str = Field("default", min_length=1, description="Unique group name (keys LRs in logs and checkpoints).")
    weight_decay: float = Field(0.0, ge=0.0, description="Weight decay coefficient; >= 0; 0 = off.")
    independent_weight_decay: bool = Field(
        False,
        description="Decay by weight_decay per step independent of the LR (p *= 1 - wd) instead of p *= 1 - lr*wd.",
    )
    learning_rate_scheduler: LearningRateSchedulerConfig = Field(
        default_factory=LearningRateSchedulerConfig,
        description="LR schedule of this group.",
    )
    parameters_include: tuple[str, ...] = Field(
        (".*",),
        description="Regexes (re.search) over parameter names selecting this group's parameters in "
        "build_parameter_groups; unused when a group is built by hand.",
    )
    parameters_exclude: tuple[str, ...] = Field(
        (), description="Regexes removing parameters from parameters_include's matches in build_parameter_groups."
    )
    method: OptimizerMethod | None = Field(
        None,
        description="This group's update rule, overriding the optimizer's method (None: the optimizer's). The "
        "Muon recipe: 'muon' for the hidden matrices, 'adamw' for the embeddings and the output head.",
    )

    @field_validator("method", mode="before")
    @classmethod
    def _method(cls, value: object) -> object:
        return _known_method(value)


def muon_offload_refusal(what: str) -> str:
    """Why Muon is refused with ``cpu_offload`` (``what``: the setting that asks for Muon)."""
    return (
        f"{what} with cpu_offload=True: Muon orthogonalises whole matrices gathered on the device, and the offloaded "
        "update runs on host shards; set cpu_offload=False, or 'adamw' for that group"
    )


def _known_method(value: object) -> object:
    if isinstance(value, str) and value not in ("adamw", "adam", "sgd", "muon"):
        raise ValueError(f"unknown optimizer method={value!r}; choose 'adamw', 'adam', 'sgd' or 'muon'")
    return value


class MuonConfig(BaseConfig):
    """Muon's settings (``method='muon'``): momentum, then the whole matrix orthogonalised by Newton-Schulz.

    The update of a matrix ``W`` of logical shape ``(A, B)`` with gradient ``G`` (torch.optim.Muon's):
    ``M = lerp(M, G, 1 - momentum)``; ``U = lerp(G, M, momentum)`` (Nesterov) or ``M``; ``O = NS(U)`` (``ns_steps``
    quintic iterations with ``ns_coefficients`` on ``U / max(|U|_F, eps)`` in ``ns_dtype``);
    ``W -= lr * weight_decay * W``; ``W -= adjust(lr, A, B) * O``. The matrix is the logical one:
    under ZeRO its shards and under tensor parallelism its TP pieces are gathered first, so every
    layout takes the same update.
    """

    momentum: float = Field(0.95, ge=0.0, lt=1.0, description="Momentum of the gradient, in [0, 1).")
    nesterov: bool = Field(True, description="Orthogonalise lerp(G, M, momentum) (Nesterov) instead of M.")
    ns_steps: int = Field(5, ge=1, le=20, description="Newton-Schulz iterations, 1 to 20.")
    ns_coefficients: tuple[float, float, float] = Field(
        (3.4445, -4.7750, 2.0315), description="The quintic iteration's (a, b, c) (Keller Jordan's)."
    )
    eps: float = Field(1e-7, gt=0.0, description="Floor of the Frobenius norm the matrix is divided by; > 0.")
    adjust_lr: MuonLearningRateAdjustment = Field(
        "match_rms_adamw",
        description="Learning rate of a matrix (A, B): 'match_rms_adamw' lr * 0.2 * sqrt(max(A, B)) (Moonlight's: "
        "the update's RMS matches AdamW's, so AdamW's learning rate and weight decay carry over), 'original' "
        "lr * sqrt(max(1, A / B)) (Keller Jordan's; Muon's own learning rates, ~0.02), 'none' lr.",
    )
    ns_dtype: Literal["bfloat16", "float32"] = Field(
        "bfloat16",
        description="Precision of the Newton-Schulz iterations: bfloat16 as the reference (and torch.optim.Muon) "
        "does, or float32 (about 4x the matmul time on a GPU; layouts then agree to fp32 rounding).",
    )


class OptimizerConfig(BaseConfig):
    """The optimizer: update rule, ZeRO stage, clipping, precision and the non-finite policy."""

    method: OptimizerMethod = Field(
        "adamw",
        description="Update rule: 'adamw', 'adam' (L2 in the grad), 'sgd' or 'muon' (Muon for the groups' 2-D "
        "parameters, AdamW with beta1/beta2/eps for their other ones; a group's own method overrides it).",
    )
    beta1: float = Field(0.9, ge=0.0, lt=1.0, description="Adam first-moment decay, in [0, 1).")
    beta2: float = Field(0.999, ge=0.0, lt=1.0, description="Adam second-moment decay, in [0, 1).")
    eps: float = Field(1e-8, gt=0.0, description="Adam denominator epsilon; > 0.")
    momentum: float = Field(0.0, ge=0.0, lt=1.0, description="SGD momentum, in [0, 1); 0 = plain SGD.")
    gradient_clipping: float = Field(
        0.0, ge=0.0, description="Clip the global gradient L2 norm to this value; 0 = no clipping."
    )
    zero_stage: int = Field(
        0,
        ge=0,
        le=3,
        description="ZeRO stage over the data-parallel group: 0 replicated, 1 shards master weights and "
        "optimizer state, 2 also gradients, 3 also parameters.",
    )
    allreduce_bucket_size: int = Field(
        25_000_000, gt=0, description="Bytes per gradient communication bucket; bounds transient buffers; > 0."
    )
    master_weights: bool = Field(
        True,
        description="For bf16/fp16 parameters keep fp32 master weights and fp32 optimizer state (fp32 "
        "parameters are their own master).",
    )
    grad_reduce_in_fp32: bool = Field(
        True,
        description="bf16/fp16 parameters: gradients travel over data parallelism (ZeRO 0-3, HSDP) in fp32, so "
        "the sum over ranks is not rounded to 8 or 11 bits at each step of the collective, and with master "
        "weights a step's micro-batches are summed in fp32 too (Megatron-LM's grad_reduce_in_fp32 / "
        "accumulate_allreduce_grads_in_fp32, on for bf16; torchtitan's reduce_dtype=float32); twice the bytes "
        "of a 16-bit reduction. False: both in the parameters' dtype. fp32 parameters use fp32 either way.",
    )
    loss_scaler: LossScalerConfig = Field(
        default_factory=LossScalerConfig,
        description="Dynamic loss scaling (fp16).",
    )
    muon: MuonConfig = Field(default_factory=MuonConfig, description="Muon's settings, for groups updated by Muon.")
    non_finite_policy: NonFinitePolicy = Field(
        "fail",
        description="On a non-finite loss or gradient (outside loss-scaler overflow): 'fail' raises "
        "FloatingPointError naming the step on every rank before the update (the run ends non-zero and saves "
        "nothing after its last good step; Megatron-LM's check_for_nan_in_loss_and_grad), or 'skip' the update "
        "on every rank and train on.",
    )
    overlap_param_gather: bool = Field(
        False,
        description="ZeRO 1/2: step() starts the all-gather of the updated shards and returns; each module waits "
        "for its own parameters just before its forward (Megatron-LM's --overlap-param-gather). Hooks into the "
        "model: BaseTrainer attaches it, otherwise pass Optimizer(..., model=...).",
    )
    cpu_offload: bool = Field(
        False,
        description="Keep the optimizer state and an fp32 master copy of each owned shard in host memory (pinned "
        "on CUDA) and run the update there (ZeRO-Offload, FSDP2's CPUOffloadPolicy for the optimizer): the "
        "device holds no optimizer state; gradients go to the host and updated shards come back each step "
        "(under ZeRO-3 in a thread that the next forward's first gather waits for). On a CPU device host and "
        "device memory are the same and nothing moves.",
    )
    zero3_reshard_after_forward: bool = Field(
        True,
        description="ZeRO-3: free each layer's parameters after its forward and gather them again for its "
        "backward (least memory). False keeps a layer whole from its first use until the optimizer step: one "
        "all-gather per layer per step instead of two per micro-batch, for the memory of the stage's whole "
        "parameters (FSDP2's reshard_after_forward=False, what torchtitan uses for pipeline stages).",
    )

    @model_validator(mode="after")
    def _check(self) -> OptimizerConfig:
        if self.overlap_param_gather and self.zero_stage not in (1, 2):
            raise ValueError(
                f"overlap_param_gather=True applies to zero_stage 1 or 2 (the stages that gather updated shards), "
                f"got zero_stage={self.zero_stage}; set zero_stage=1 or 2, or overlap_param_gather=False"
            )
        if self.method == "muon" and self.cpu_offload:
            raise ValueError(muon_offload_refusal("method='muon'"))
        if not self.zero3_reshard_after_forward and self.zero_stage != 3:
            raise ValueError(
                f"zero3_reshard_after_forward=False applies to zero_stage=3 (the stage that frees parameters), got "
                f"zero_stage={self.zero_stage}; set zero_stage=3, or leave zero3_reshard_after_forward at True"
            )
        return self

    @field_validator("method", mode="before")
    @classmethod
    def _method(cls, value: object) -> object:
        return _known_method(value)
