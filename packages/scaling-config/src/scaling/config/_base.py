"""BaseConfig: frozen pydantic models loaded from YAML, JSON, dicts and dotted overrides."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, SecretBytes, SecretStr
from pydantic_core import to_jsonable_python

from scaling.config._overrides import Overrides, apply_overrides

C = TypeVar("C", bound="BaseConfig")

_SECRET_TYPES = (SecretStr, SecretBytes)


class BaseConfig(BaseModel):
    """Base class of every Scaling config.

    Configs are frozen (hashable, never mutated after validation), reject unknown keys
    (``extra="forbid"``) and validate defaults. Every field must carry a ``description``;
    a subclass that omits one fails at class creation so the template and schema are
    always complete.

    Example::

        class Train(BaseConfig):
            steps: int = Field(10, gt=0, description="Optimizer steps to run, > 0.")

        cfg = Train.from_dict({}, overrides=["steps=20"])
    """

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)

    # Set to False on a subclass to allow fields without descriptions (tests only).
    _require_descriptions: ClassVar[bool] = True

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        if not cls._require_descriptions:
            return
        missing = [name for name, f in cls.model_fields.items() if not f.description]
        if missing:
            raise TypeError(
                f"{cls.__name__}: every config field needs a description; "
                f"missing for {sorted(missing)}. Add Field(..., description='...')."
            )

    # ----------------------------------------------------------------- loading
    @classmethod
    def from_dict(cls: type[C], data: Mapping[str, Any], overrides: Overrides = None) -> C:
        """Validate ``data`` after applying ``overrides``.

        Args:
            data: nested mapping of field values.
            overrides: either a mapping of dotted keys to values
                (``{"topology.data_parallel_size": 2}``) or a sequence of
                ``"dotted.key=value"`` strings as typed on a command line; string values
                are parsed as YAML scalars and then coerced by the schema.

        Raises:
            pydantic.ValidationError: (a ``ValueError``) naming the dotted path of every
                bad field, the value received and what is allowed.
            ValueError: for a malformed override string.
        """
        merged = apply_overrides(dict(data), overrides)
        return cls.model_validate(merged)

    @classmethod
    def from_yaml(cls: type[C], path: str | Path, overrides: Overrides = None) -> C:
        """Load a YAML file (``yaml.safe_load``: no Python object tags) and validate it."""
        return cls.from_dict(_load_mapping(Path(path), yaml.safe_load), overrides)

    @classmethod
    def from_json(cls: type[C], path: str | Path, overrides: Overrides = None) -> C:
        """Load a JSON file and validate it."""
        return cls.from_dict(_load_mapping(Path(path), json.loads), overrides)

    @classmethod
    def from_file(cls: type[C], path: str | Path, overrides: Overrides = None) -> C:
        """Load ``.yml``/``.yaml`` as YAML and anything else as JSON."""
        p = Path(path)
        if p.suffix in (".yml", ".yaml"):
            return cls.from_yaml(p, overrides)
        return cls.from_json(p, overrides)

    # ----------------------------------------------------------------- dumping
    def as_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict of the config with every secret field left out.

        Secrets (``SecretStr``/``SecretBytes``) travel through the environment, never
        through dumps, payloads, logs or checkpoints.
        """
        raw = self.model_dump(mode="python", round_trip=True)
        cleaned = _drop_secrets(raw)
        result = to_jsonable_python(cleaned)
        assert isinstance(result, dict)
        return result

    def save(self, path: str | Path) -> None:
        """Write :meth:`as_dict` to ``path``: YAML for ``.yml``/``.yaml``, else JSON."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        data = self.as_dict()
        if p.suffix in (".yml", ".yaml"):
            text = yaml.safe_dump(data, sort_keys=False)
        else:
            text = json.dumps(data, indent=2)
        p.write_text(text)

    @classmethod
    def json_schema(cls) -> dict[str, Any]:
        """The JSON schema of this config (pydantic's, with field descriptions)."""
        return cls.model_json_schema()

    @classmethod
    def template(cls) -> str:
        """A commented YAML template: every field with its description and default."""
        from scaling.config._template import render_template

        return render_template(cls)


def _load_mapping(path: Path, parse: Any) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"config file {str(path)!r} does not exist; pass the path of a YAML or JSON config")
    data = parse(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {str(path)!r} must hold a mapping at the top level, got {type(data).__name__}")
    return data


def _drop_secrets(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_secrets(v) for k, v in value.items() if not isinstance(v, _SECRET_TYPES)}
    if isinstance(value, (list, tuple)):
        return type(value)(_drop_secrets(v) for v in value if not isinstance(v, _SECRET_TYPES))
    return value


__all__ = ["BaseConfig"]
