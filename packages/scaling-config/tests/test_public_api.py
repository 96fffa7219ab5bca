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
        "is_secret_name",
        "load_mapping",
        "looks_like_secret",
        "parse_override",
        "secret_assignments",
    ]
