from scaling.optim import LossScaler, LossScalerConfig


def test_disabled_scaler_is_one():
    s = LossScaler(LossScalerConfig())
    s.update(overflow=True)
    assert s.scale == 1.0 and not s.enabled


def test_shrink_after_hysteresis_grow_after_window():
    s = LossScaler(LossScalerConfig(enable=True, initial_scale=64.0, window=3, hysteresis=2, min_scale=8.0))
    s.update(overflow=True)
    assert s.scale == 64.0  # first overflow spends the hysteresis budget
    s.update(overflow=True)
    assert s.scale == 32.0
    s.update(overflow=True)  # budget stays spent until the next growth
    assert s.scale == 16.0
    for _ in range(2):
        s.update(overflow=False)
    assert s.scale == 16.0 and s.no_overflow_steps == 2
    s.update(overflow=False)
    assert s.scale == 32.0  # grew after the window, budget refilled
    s.update(overflow=True)
    assert s.scale == 32.0 and s.no_overflow_steps == 0


def test_min_scale_and_consecutive_hysteresis():
    s = LossScaler(
        LossScalerConfig(
            enable=True, initial_scale=4.0, hysteresis=2, min_scale=2.0, consecutive_hysteresis=True, window=100
        )
    )
    for _ in range(6):
        s.update(overflow=True)
    assert s.scale == 2.0
    s.update(overflow=False)  # refills the budget without growing
    s.update(overflow=True)
    assert s.hysteresis_left == 1 and s.scale == 2.0


def test_state_round_trip():
    s = LossScaler(LossScalerConfig(enable=True, initial_scale=1024.0, window=2))
    s.update(overflow=True)
    s.update(overflow=True)
    s.update(overflow=False)
    other = LossScaler(s.config)
    other.load_state_dict(s.state_dict())
    assert other.state_dict() == s.state_dict() == {"scale": 512.0, "no_overflow_steps": 1, "hysteresis_left": 1}
