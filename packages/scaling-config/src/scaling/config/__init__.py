"""scaling.config: frozen pydantic configs with YAML/JSON/CLI loading."""

from scaling.config._base import BaseConfig, load_mapping
from scaling.config._overrides import Overrides, apply_overrides, parse_override
from scaling.config._secrets import is_secret_name, looks_like_secret, secret_assignments
from scaling.config._types import JsonDict, JsonMapping, Metrics, StateDict

__all__ = [
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
