import scaling.config


def test_public_api():
    assert sorted(scaling.config.__all__) == [
        "BaseConfig",
        "Overrides",
        "apply_overrides",
        "load_mapping",
        "parse_override",
    ]
