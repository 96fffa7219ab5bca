"""Bad config files, values and secrets on the command line: refused clearly, exit code 2, nothing leaked.

Both entry points a user types (``python -m scaling.mlp`` and ``scaling-run``) report a
YAML or JSON file that does not parse with the file, line and column and the parser's
message, instead of a traceback; ``scaling-run`` takes its options anywhere on the line.
A secret value never appears in a config error, whichever way it got into the config;
integer fields refuse booleans and float fields refuse infinities and NaN.
"""

from __future__ import annotations

import re

import pytest

from scaling.mlp.__main__ import DEFAULT_CONFIG as DEFAULT_MLP_CONFIG
from scaling.mlp.__main__ import main as mlp_main
from scaling.runner._cli import main as run_main

BROKEN = [
    ("config.yml", "runner:\n  nproc_per_node: [1, 2\ntopology: {}\n", r"line 3, column 9: not valid YAML: .*expected ',' or ']'"),
    ("config.yml", "runner: !!python/object/apply:os.system ['true']\n", r"line 1, column 9: not valid YAML: .*python/object"),
    ("config.json", '{"runner": {"nproc_per_node": 1,}}', r"line 1, column 33: not valid JSON: Expecting property name"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "text", "message"), BROKEN)
@pytest.mark.parametrize("entry", ["scaling.mlp", "scaling-run"])
def test_a_file_that_does_not_parse_exits_2_naming_file_line_and_column(tmp_path, capsys, entry, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    main = mlp_main if entry == "scaling.mlp" else run_main
    assert main([str(path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert f"config file {str(path)!r}, " in err
    assert re.search(message, err), err


def test_scaling_run_takes_options_after_the_config_and_between_overrides(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text("")
    path = tmp_path / "config.yml"
    path.write_text(f"runner:\n  script: {script}\n")
    assert run_main([str(path), "--dry-run", "runner.nproc_per_node=3"]) == 0
    assert "--nproc-per-node 3" in capsys.readouterr().out
    assert run_main([str(path), "runner.nproc_per_node=2", "--dry-run", "runner.max_restarts=1"]) == 0
    out = capsys.readouterr().out
    assert "--nproc-per-node 2" in out and "--max-restarts 1" in out


# ----------------------------------------------------------------- secrets and values
SECRET = "8cab69f1d2e3a4b5c6d7e8f90123456789abcdef"


def _mlp_error(tmp_path, capsys, *overrides: str) -> str:
    assert mlp_main([*overrides]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_a_secret_never_appears_in_a_config_error(tmp_path, capsys):
    from pydantic import Field, SecretStr, ValidationError, model_validator

    from scaling.config import BaseConfig
    from scaling.runner import RunnerConfig

    # A secret under an unknown key (pydantic's "Extra inputs are not permitted").
    err = _mlp_error(tmp_path, capsys, str(DEFAULT_MLP_CONFIG), f"logger.wandb_api_key={SECRET}")
    assert SECRET not in err and SECRET[:6] not in err and "logger.wandb_api_key" in err and "**********" in err
    # A secret in runner.env, refused by the validator that names it.
    with pytest.raises(ValidationError) as info:
        RunnerConfig(env={"WANDB_API_KEY": SECRET, "MODE": "fast"})
    assert SECRET not in str(info.value) and SECRET[:6] not in str(info.value)
    assert "'WANDB_API_KEY' looks like a secret" in str(info.value) and "'MODE': 'fast'" in str(info.value)

    # A SecretStr field, in the input a model-level check reports.
    class Creds(BaseConfig):
        token: SecretStr = Field(description="an API token")
        retries: int = Field(description="attempts, >= 1")

        @model_validator(mode="after")
        def _check(self) -> Creds:
            if self.retries < 1:
                raise ValueError(f"retries={self.retries} must be >= 1")
            return self

    with pytest.raises(ValidationError) as info:
        Creds.from_dict({"token": SECRET, "retries": 0})
    assert SECRET not in str(info.value) and "retries=0 must be >= 1" in str(info.value)


def test_a_bare_api_key_is_not_written_to_the_payload(tmp_path):
    from scaling.runner import RunnerConfig, runner_main

    script = tmp_path / "train.py"
    script.write_text("")
    with pytest.raises(ValueError, match=r"payload holds secret-looking keys \['service.api_key'\]"):
        runner_main(RunnerConfig(script=str(script)), payload={"service": {"api_key": SECRET}}, dry_run=True)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.train_iterations=yes", r"train_iterations got the boolean True; give a number"),
        ("learning_rate_scheduler.learning_rate=.inf", r"learning_rate\n  Input should be a finite number"),
        ("topology.timeout_seconds=.nan", r"timeout_seconds\n  Input should be a finite number"),
    ],
)
def test_numbers_are_numbers_and_finite(tmp_path, capsys, override, message):
    err = _mlp_error(tmp_path, capsys, str(DEFAULT_MLP_CONFIG), override)
    assert re.search(message, err), err


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("trainer.train_iterations=18446744073709551616", "train_iterations=18446744073709551616 does not fit"),
        ("topology.global_batch_size=99999999999999999999", "global_batch_size=99999999999999999999 does not fit"),
        ("trainer.seed=-1", "trainer.seed\n  Input should be greater than or equal to 0"),
        ("trainer.seed=18446744073709551616", "seed=18446744073709551616 does not fit"),
        ("learning_rate_scheduler.learning_rate=1e308", "learning_rate=1e+308 is above 10"),
        ("topology.timeout_seconds=1e300", "timeout_seconds\n  Input should be less than or equal to 604800"),
        ("training.compile.backend=inductr", "backend='inductr' is not a torch.compile backend of torch"),
        (
            "training.compile.enabled=true training.compile.fullgraph=true",  # the default layout has tp=2
            "training.compile.fullgraph=true with topology.model_parallel_size=2: the layers' collectives break",
        ),
    ],
)
def test_out_of_range_values_are_refused_before_launch(tmp_path, capsys, override, named):
    err = _mlp_error(tmp_path, capsys, str(DEFAULT_MLP_CONFIG), *override.split())
    assert named in err, err
