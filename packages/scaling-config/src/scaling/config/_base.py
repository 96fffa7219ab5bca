"""BaseConfig: frozen pydantic models loaded from YAML, JSON, dicts and dotted overrides."""

from __future__ import annotations

import json
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator
from pydantic_core import to_jsonable_python

from scaling.config._overrides import Overrides, apply_overrides
from scaling.config._secrets import MASK, SECRET_TYPES, is_secret_name, masked_error
from scaling.config._types import JsonDict, JsonMapping

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
C = TypeVar("C", bound="BaseConfig")


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

    # allow_inf_nan=False: a float field takes finite numbers only, unless its Field says
    # allow_inf_nan=True (an infinite learning rate or timeout is a typo, not a setting).
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True, allow_inf_nan=False)

    # Set to False on a subclass to allow fields without descriptions (tests only).
    _require_descriptions: ClassVar[bool] = True

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: object) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        if not cls._require_descriptions:
            return
        missing = [name for name, f in cls.model_fields.items() if not f.description]
        if missing:
            raise TypeError(
                f"{cls.__name__}: every config field needs a description; "
                f"missing for {sorted(missing)}. Add Field(..., description='...')."
            )

    def __init__(self, **data: object) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise masked_error(exc, data, type(self)) from None

    @classmethod
    # Any: the keywords go to pydantic's model_validate, whose set varies by pydantic version.
    def model_validate(cls: type[C], obj: object, **kwargs: Any) -> C:  # type: ignore[override, unused-ignore]
        """pydantic's ``model_validate``, with secrets masked in any error (see ``_secrets.py``)."""
        try:
            return super().model_validate(obj, **kwargs)
        except ValidationError as exc:
            raise masked_error(exc, obj, cls) from None

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value: object, info: ValidationInfo) -> object:
        # pydantic would read a YAML `yes`/`true` as 1 in an int field (and 1.0 in a float one).
        if isinstance(value, bool) and info.field_name is not None:
            annotation = cls.model_fields[info.field_name].annotation
            allowed = {annotation, *typing.get_args(annotation)}
            if bool not in allowed and allowed & {int, float}:
                raise ValueError(
                    f"{info.field_name} got the boolean {value}; give a number (YAML reads yes/no/true/false as booleans)"
                )
        return value

    @field_validator("*", mode="after")
    @classmethod
    def _int_fits_int64(cls, value: object, info: ValidationInfo) -> object:
        # Python's ints are unbounded; torch, numpy and the C APIs behind them are not (a step
        # count of 2**64 trains until killed, a seed of 2**64 fails inside the ranks).
        if type(value) is int and not INT64_MIN <= value <= INT64_MAX:
            raise ValueError(
                f"{info.field_name}={value} does not fit a 64-bit integer "
                f"({INT64_MIN} to {INT64_MAX}); give a smaller number"
            )
        return value

    # ----------------------------------------------------------------- loading
    @classmethod
    def from_dict(cls: type[C], data: JsonMapping, overrides: Overrides = None) -> C:
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
    def as_dict(self) -> JsonDict:
        """A JSON-serialisable dict of the config with every secret field left out.

        Secrets (``SecretStr``/``SecretBytes``) travel through the environment, never
        through dumps, payloads, logs or checkpoints; a plain string under a secret-looking
        key (``api_key``, ``hf_token``, ``client_secret``, ...) is replaced by ``**********``.
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
    def json_schema(cls) -> JsonDict:
        """The JSON schema of this config (pydantic's, with field descriptions)."""
        return cls.model_json_schema()

    @classmethod
    def template(cls) -> str:
        """A commented YAML template: every field with its description and default."""
        from scaling.config._template import render_template

        return render_template(cls)


def load_mapping(path: str | Path) -> JsonDict:
    """The mapping in a YAML (``.yml``/``.yaml``) or JSON (anything else) config file.

    YAML is read with ``yaml.safe_load``: no Python object tags.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: the file does not parse (the message names the file, line, column
            and the parser's complaint) or holds no mapping at the top level.
    """
    p = Path(path)
    return _load_mapping(p, yaml.safe_load if p.suffix in (".yml", ".yaml") else json.loads)


def _load_mapping(path: Path, parse: Callable[[str], object]) -> JsonDict:
    if not path.is_file():
        raise FileNotFoundError(f"config file {str(path)!r} does not exist; pass the path of a YAML or JSON config")
    try:
        data = parse(path.read_text()) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = " ".join(str(x) for x in (getattr(exc, "context", None), getattr(exc, "problem", None)) if x)
        raise ValueError(f"config file {str(path)!r}{where}: not valid YAML: {problem or exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"config file {str(path)!r}, line {exc.lineno}, column {exc.colno}: not valid JSON: {exc.msg}"
        ) from None
    if not isinstance(data, dict):
        raise ValueError(f"config file {str(path)!r} must hold a mapping at the top level, got {type(data).__name__}")
    return data


def _drop_secrets(value: object) -> object:
    if isinstance(value, dict):
        return {
            k: MASK if isinstance(v, str) and v and is_secret_name(str(k)) else _drop_secrets(v)
            for k, v in value.items()
            if not isinstance(v, SECRET_TYPES)
        }
    if isinstance(value, (list, tuple)):
        return type(value)(_drop_secrets(v) for v in value if not isinstance(v, SECRET_TYPES))
    return value


__all__ = ["BaseConfig", "load_mapping"]
