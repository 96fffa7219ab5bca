import scaling.runner


def test_public_api_is_pinned():
    assert sorted(scaling.runner.__all__) == sorted(
        [
            "PAYLOAD_INLINE_ENV",
            "PAYLOAD_PATH_ENV",
            "SECRET_PATTERNS",
            "DockerConfig",
            "HostSpec",
            "Launch",
            "LaunchedConfig",
            "RankFailure",
            "RunnerConfig",
            "SlurmConfig",
            "free_port",
            "is_secret",
            "load_payload",
            "main",
            "plan",
            "runner_main",
        ]
    )
    for name in scaling.runner.__all__:
        assert getattr(scaling.runner, name) is not None


def test_config_import_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, scaling.runner; scaling.runner.RunnerConfig(runner_type='pdsh', script='x.py', hosts=['a']); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_worker_reading_its_payload_imports_neither_pydantic_nor_the_config_layer(tmp_path):
    import subprocess
    import sys

    (tmp_path / "p.json").write_text('{"lr": 0.1}')
    code = (
        "import sys; from scaling.runner import load_payload; assert load_payload() == {'lr': 0.1}; "
        "print(sorted(m for m in ('pydantic', 'scaling.config') if m in sys.modules))"
    )
    env = {"SCALING_PAYLOAD_PATH": str(tmp_path / "p.json"), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == "[]"
