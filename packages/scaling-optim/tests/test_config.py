import math

import pytest

from scaling.optim import (
    LearningRateScheduler,
    LearningRateSchedulerConfig,
    LossScalerConfig,
    OptimizerConfig,
    OptimizerParamGroupConfig,
)


def lr_at(step, **kwargs):
    return LearningRateScheduler(LearningRateSchedulerConfig(**kwargs)).get_lr(step)


def test_defaults_and_walkthrough_shape():
    cfg = OptimizerParamGroupConfig(
        name="weight_decay_params",
        weight_decay=0.1,
        learning_rate_scheduler=LearningRateSchedulerConfig(learning_rate=1e-3, learning_rate_decay_style="constant"),
    )
    assert cfg.learning_rate_scheduler.learning_rate == 1e-3
    opt = OptimizerConfig.from_dict({}, overrides=["zero_stage=2", "loss_scaler.enable=true"])
    assert (opt.method, opt.zero_stage, opt.loss_scaler.enable) == ("adamw", 2, True)


def test_every_field_has_a_description():
    for cls in (OptimizerConfig, OptimizerParamGroupConfig, LearningRateSchedulerConfig, LossScalerConfig):
        assert all(f.description for f in cls.model_fields.values()), cls


@pytest.mark.parametrize("style", ["constant", "linear", "cosine", "inverse_sqrt"])
def test_warmup_is_linear_after_the_delay(style):
    kw = dict(
        learning_rate=1.0,
        learning_rate_warmup_steps=4,
        learning_rate_warmup_delay_steps=2,
        learning_rate_decay_style=style,
        learning_rate_decay_iters=20,
    )
    assert [lr_at(s, **kw) for s in range(1, 7)] == [0.0, 0.0, 0.25, 0.5, 0.75, 1.0]


def test_decay_styles_reach_the_minimum():
    kw = dict(learning_rate=1.0, learning_rate_minimum=0.1, learning_rate_warmup_steps=2, learning_rate_decay_iters=12)
    # halfway through the decay (step 7 of 2..12)
    assert lr_at(7, learning_rate_decay_style="linear", **kw) == pytest.approx(0.55)
    assert lr_at(7, learning_rate_decay_style="cosine", **kw) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_at(4, learning_rate_decay_style="cosine", **kw) == pytest.approx(
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.2))
    )
    for style in ("linear", "cosine"):
        assert lr_at(12, learning_rate_decay_style=style, **kw) == pytest.approx(0.1)
        assert lr_at(100, learning_rate_decay_style=style, **kw) == 0.1
    assert lr_at(50, learning_rate_decay_style="constant", **kw) == 1.0


def test_inverse_sqrt():
    kw = dict(
        learning_rate=1.0,
        learning_rate_minimum=0.05,
        learning_rate_warmup_steps=4,
        learning_rate_decay_style="inverse_sqrt",
    )
    assert lr_at(4, **kw) == 1.0
    assert lr_at(16, **kw) == pytest.approx(0.5)
    assert lr_at(10_000, **kw) == 0.05


def test_scheduler_state_round_trip():
    sched = LearningRateScheduler(
        LearningRateSchedulerConfig(
            learning_rate=1.0, learning_rate_warmup_steps=10, learning_rate_decay_style="constant"
        )
    )
    for _ in range(3):
        sched.step()
    other = LearningRateScheduler(sched.config)
    other.load_state_dict(sched.state_dict())
    assert other.current_lr == sched.current_lr == 0.4


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(learning_rate=-0.1), r"learning_rate=-0.1 is negative"),
        (dict(learning_rate_minimum=-1.0), r"learning_rate_minimum=-1.0 is negative"),
        (dict(learning_rate=0.1, learning_rate_minimum=0.2), r"learning_rate_minimum=0.2 is above learning_rate=0.1"),
        (
            dict(learning_rate_warmup_steps=100, learning_rate_decay_style="cosine", learning_rate_decay_iters=50),
            r"learning_rate_decay_iters=50 for decay style .cosine.; warmup longer than the schedule",
        ),
        (
            dict(
                learning_rate_warmup_steps=5,
                learning_rate_warmup_delay_steps=5,
                learning_rate_decay_style="linear",
                learning_rate_decay_iters=10,
            ),
            r"= 10 is not shorter than learning_rate_decay_iters=10",
        ),
        (dict(learning_rate_decay_style="exp"), r"learning_rate_decay_style"),
        (dict(learning_rate=1e308), r"learning_rate=1e\+308 is above 10: .*lower it"),
        (dict(learning_rate_minimum=11), r"learning_rate_minimum=11.0 is above 10"),
    ],
)
def test_schedule_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LearningRateSchedulerConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(method="lamb"), r"unknown optimizer method='lamb'; choose 'adamw', 'adam', 'sgd' or 'muon'"),
        (dict(zero_stage=4), r"zero_stage"),
        (dict(beta2=1.0), r"beta2"),
        (dict(gradient_clipping=-1.0), r"gradient_clipping"),
        (dict(non_finite_policy="ignore"), r"non_finite_policy"),
        (dict(loss_scaler={"min_scale": 8.0, "initial_scale": 4.0}), r"min_scale=8.0 is above initial_scale=4.0"),
        (dict(bogus=1), r"bogus"),
        (
            dict(overlap_param_gather=True),
            r"overlap_param_gather=True applies to zero_stage 1 or 2 .*got zero_stage=0; set zero_stage=1 or 2",
        ),
    ],
)
def test_optimizer_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OptimizerConfig(**kwargs)
