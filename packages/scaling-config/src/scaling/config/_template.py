"""A commented YAML template rendered from field descriptions and defaults."""

from __future__ import annotations

import inspect
import textwrap
import typing

import yaml
from pydantic import BaseModel
from pydantic_core import PydanticUndefined, to_jsonable_python


def _nested_model(annotation: object) -> type[BaseModel] | None:
    candidates = [annotation, *typing.get_args(annotation)]
    for c in candidates:
        if inspect.isclass(c) and issubclass(c, BaseModel):
            return c
    return None


def _scalar(value: object) -> str:
    text = yaml.safe_dump(value, default_flow_style=True).strip()
    return text.removesuffix("\n...").removesuffix("...").strip()


def render_template(model: type[BaseModel], indent: int = 0) -> str:
    """Render ``model`` as YAML, each field preceded by its description as a comment."""
    pad = "  " * indent
    lines: list[str] = []
    for name, field in model.model_fields.items():
        for line in textwrap.wrap(field.description or "", width=88 - len(pad)):
            lines.append(f"{pad}# {line}")
        nested = _nested_model(field.annotation)
        default = field.default
        if field.default_factory is not None:
            default = field.default_factory()  # type: ignore[call-arg]
        if nested is not None and (default is PydanticUndefined or isinstance(default, BaseModel)):
            lines.append(f"{pad}{name}:")
            lines.append(render_template(nested, indent + 1))
            continue
        if default is PydanticUndefined:
            lines.append(f"{pad}{name}: null  # required")
        else:
            lines.append(f"{pad}{name}: {_scalar(to_jsonable_python(default))}")
    return "\n".join(lines)
