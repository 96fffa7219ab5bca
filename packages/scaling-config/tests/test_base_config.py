import json

import pytest
import yaml
from pydantic import Field, SecretStr, ValidationError

from scaling.config import BaseConfig, parse_override


class Inner(BaseConfig):
    size: int = Field(2, gt=0, description="A size, > 0.")
    api_key: SecretStr | None = Field(None, description="A secret; never dumped.")


class Outer(BaseConfig):
    name: str = Field(description="Run name.")
    rate: float = Field(0.1, description="A rate.")
    flags: list[str] = Field(default_factory=list, description="Flags.")
    inner: Inner = Field(default_factory=Inner, description="The inner section.")


def test_from_dict_with_string_overrides_coerced_by_schema():
    cfg = Outer.from_dict({"name": "a"}, overrides=["inner.size=4", "rate=1e-3", "flags=[x, y]"])
    assert cfg.inner.size == 4 and cfg.rate == 1e-3 and cfg.flags == ["x", "y"]


def test_mapping_overrides():
    cfg = Outer.from_dict({"name": "a", "inner": {"size": 3}}, overrides={"inner.size": 5, "name": "b"})
    assert (cfg.name, cfg.inner.size) == ("b", 5)


def test_yaml_and_json_roundtrip(tmp_path):
    cfg = Outer.from_dict({"name": "a", "inner": {"size": 7}})
    for suffix in (".yml", ".json"):
        path = tmp_path / f"c{suffix}"
        cfg.save(path)
        assert Outer.from_file(path) == cfg
    assert Outer.from_yaml(tmp_path / "c.yml", overrides=["inner.size=9"]).inner.size == 9
    assert Outer.from_json(tmp_path / "c.json").inner.size == 7


def test_errors_name_dotted_path_value_and_allowed():
    with pytest.raises(ValidationError, match=r"inner\.size\n  Input should be greater than 0.*input_value=-1"):
        Outer.from_dict({"name": "a"}, overrides=["inner.size=-1"])
    with pytest.raises(ValidationError, match=r"inner\.colour\n  Extra inputs are not permitted"):
        Outer.from_dict({"name": "a"}, overrides=["inner.colour=red"])
    with pytest.raises(ValidationError, match=r"rate\n  Input should be a valid number.*input_value='fast'"):
        Outer.from_dict({"name": "a", "rate": "fast"})
    with pytest.raises(ValidationError, match=r"name\n  Field required"):
        Outer.from_dict({})


def test_bad_override_strings():
    with pytest.raises(ValueError, match=r"override 'inner\.size' is not of the form dotted\.key=value"):
        parse_override("inner.size")
    with pytest.raises(ValueError, match=r"'name' holds 'a', not a section"):
        Outer.from_dict({"name": "a"}, overrides=["name.x=1"])
    with pytest.raises(TypeError, match="not a single string"):
        Outer.from_dict({"name": "a"}, overrides="name=b")  # type: ignore[arg-type]


def test_missing_file_and_non_mapping(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Outer.from_yaml(tmp_path / "nope.yml")
    (tmp_path / "list.yml").write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="must hold a mapping at the top level, got list"):
        Outer.from_yaml(tmp_path / "list.yml")


def test_yaml_loading_is_safe(tmp_path):
    (tmp_path / "evil.yml").write_text("name: !!python/object/apply:os.system ['echo hi']\n")
    with pytest.raises(ValueError, match=r"evil.yml', line 1, column 7: not valid YAML: .*python/object/apply"):
        Outer.from_yaml(tmp_path / "evil.yml")


def test_frozen_and_forbid():
    cfg = Outer.from_dict({"name": "a"})
    with pytest.raises(ValidationError, match="frozen"):
        cfg.name = "b"  # type: ignore[misc]


def test_secrets_never_dumped(tmp_path):
    sentinel = "SENTINEL-7f3a9c"
    cfg = Outer.from_dict({"name": "a"}, overrides=[f"inner.api_key={sentinel}"])
    assert cfg.inner.api_key is not None and cfg.inner.api_key.get_secret_value() == sentinel
    assert sentinel not in json.dumps(cfg.as_dict())
    assert sentinel not in repr(cfg) and sentinel not in str(cfg)
    cfg.save(tmp_path / "c.yml")
    cfg.save(tmp_path / "c.json")
    for f in tmp_path.iterdir():
        assert sentinel not in f.read_text()
    # A dump loads back (the secret is simply absent).
    assert Outer.from_dict(cfg.as_dict()).inner.api_key is None


def test_schema_and_template_cover_every_field():
    schema = Outer.json_schema()
    assert schema["properties"]["rate"]["description"] == "A rate."
    template = Outer.template()
    assert "# The inner section.\ninner:\n  # A size, > 0.\n  size: 2" in template
    assert "name: null  # required" in template
    loaded = yaml.safe_load(template)
    assert loaded["inner"]["size"] == 2 and loaded["rate"] == 0.1


def test_every_field_needs_a_description():
    with pytest.raises(TypeError, match=r"every config field needs a description; missing for \['x'\]"):

        class Bad(BaseConfig):
            x: int = 1


def test_secret_names_are_masked_in_dumps_and_errors_but_not_their_look_alikes():
    from scaling.config._secrets import is_secret_name

    secret = ("HF_TOKEN", "client_secret", "wandb_api_key", "db.password", "apikey", "AWS_SECRET_ACCESS_KEY")
    secret += (
        "DJANGO_SECRET_KEY",
        "GITHUB_PAT",
        "AWS_ACCESS_KEY_ID",
        "GOOGLE_APPLICATION_CREDENTIALS",
        "private_key",
        "api-key",
    )
    assert [is_secret_name(n) for n in secret] == [True] * len(secret)
    plain = ("tokenizer_path", "max_tokens", "tokens_per_second", "keys", "text_key", "path", "patterns", "cache_key")
    assert not any(is_secret_name(n) for n in plain)

    class Service(BaseConfig):
        _require_descriptions = False
        api_key: str = ""
        tokenizer_path: str = ""
        port: int = 1

    cfg = Service(api_key="s3cr3t-value", tokenizer_path="/data/tok.json")
    assert cfg.as_dict() == {"api_key": "**********", "tokenizer_path": "/data/tok.json", "port": 1}
    with pytest.raises(ValidationError) as info:
        Service(api_key="s3cr3t-value", port="x")
    assert "s3cr3t" not in str(info.value) and "port\n  Input should be a valid integer" in str(info.value)


# Random keys (AWS's documented example, generated base62/64 tokens) and providers' token shapes.
SECRET_LOOKING = [
    "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
    "ghp_16C7e42F292c6912E7710c838347Ae178B4a",
    "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",
    "django-insecure-7f#k2".replace("#", "x") + "q9ZtB4mW8rLp3vYc",
    "Zx8Kq2Lm9Np4Rt7Vw1Yb3Cd6Fg",
]
# What configs and environments hold in plain sight: paths, model and run names, hashes, numbers, lists.
PLAIN_LOOKING = [
    "/usr/lib/x86_64-linux-gnu/libnccl.so.2.21.5",
    "runs/cache/inductor_0123abc",
    "meta-llama/Llama-3.1-8B-Instruct",
    "Qwen3-30B-A3B-Instruct-2507",
    "llama3-8b-sft-2026-11-28-run42",
    "6328562dd9ab7f41e2a1ad5f1a8ca6b39ce5ddf6",
    "0f7217f3-1133-4b91-a076-cb1e837ea6ea",
    "experiment_2026_11_28_baseline_v2",
    "TORCH_LOGS=+dynamo,recompiles",
    "3.0e-4",
]


@pytest.mark.parametrize("value", SECRET_LOOKING)
def test_secret_looking_values_are_recognised_whatever_their_name(value):
    from scaling.config import looks_like_secret, secret_assignments

    assert looks_like_secret(value)
    assert secret_assignments(f"--env=SOME_SETTING={value}") == [("SOME_SETTING", value)]


@pytest.mark.parametrize("value", PLAIN_LOOKING)
def test_plain_values_are_not_taken_for_secrets(value):
    from scaling.config import looks_like_secret, secret_assignments

    assert not looks_like_secret(value)
    assert secret_assignments(f"--opt={value}") == []


def test_secret_assignments_inside_strings_are_found_and_masked_in_errors():
    from scaling.config import secret_assignments

    assert secret_assignments("--export=ALL,HF_TOKEN=abc1") == [("HF_TOKEN", "abc1")]
    assert secret_assignments("--env=WANDB_API_KEY=k-123 --hf-token=zz99") == [
        ("WANDB_API_KEY", "k-123"),
        ("hf-token", "zz99"),
    ]
    assert secret_assignments("--shm-size=1g --export=ALL,HF_TOKEN") == []

    class Launch(BaseConfig):
        _require_descriptions = False
        args: list[str] = []
        port: int = 1

    with pytest.raises(ValidationError) as info:
        Launch(args=["--env=HF_TOKEN=abc1", f"--other={SECRET_LOOKING[0]}"], port="x")
    assert "abc1" not in str(info.value) and SECRET_LOOKING[0] not in str(info.value)


def test_integers_beyond_int64_are_refused_naming_the_field():
    class Counts(BaseConfig):
        _require_descriptions = False
        steps: int = 1
        offset: int | None = None

    assert Counts(steps=2**63 - 1, offset=-(2**63)).steps == 2**63 - 1
    for kwargs in ({"steps": 2**63}, {"offset": -(2**63) - 1}, {"steps": "18446744073709551616"}):
        with pytest.raises(ValidationError, match=r"(steps|offset)=-?\d+ does not fit a 64-bit integer"):
            Counts(**kwargs)


def test_booleans_and_infinities_are_refused_in_number_fields():
    class Numbers(BaseConfig):
        _require_descriptions = False
        steps: int = 1
        rate: float = 1.0
        flag: bool = False
        bound: float = Field(1.0, allow_inf_nan=True)

    assert Numbers(flag=True, bound=float("inf")).bound == float("inf")
    with pytest.raises(ValidationError, match=r"steps got the boolean True; give a number"):
        Numbers(steps=True)
    with pytest.raises(ValidationError, match=r"rate\n  Input should be a finite number"):
        Numbers(rate=float("nan"))
