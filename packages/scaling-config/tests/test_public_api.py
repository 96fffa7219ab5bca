import scaling.config


def test_public_api():
    assert sorted(scaling.config.__all__) == [
        "BaseConfig",
        "JsonDict",
        "JsonMapping",
        "Metrics",
        "Overrides",
        "StateDict",
        "apply_overrides",
        "load_mapping",
        "parse_override",
    ]
