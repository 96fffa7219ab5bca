"""Which config values are secrets, and how an error about a config keeps them out of sight.

A value is a secret when its field is typed ``SecretStr``/``SecretBytes`` or its key looks
like one: one of its words (split at ``_``, ``-`` and ``.``, any case) is ``token``,
``secret``, ``password``, ``passwd``, ``apikey``, ``pat``, ``credential(s)``, or it
contains ``api_key``, ``access_key`` or ``private_key`` (``HF_TOKEN``, ``client_secret``,
``wandb_api_key``, ``AWS_SECRET_ACCESS_KEY``, ``GITHUB_PAT``; not ``tokenizer_path`` or
``max_tokens``, which a ``*token*`` glob would hide from every error).

A value is also a secret by what it looks like, whatever its name (:func:`looks_like_secret`):
a token of a known provider's shape (``ghp_``, ``github_pat_``, ``hf_``, ``sk-``, ``xox?-``,
``glpat-``, ``AKIA``...) or 20+ characters of one word mixing letters and digits at 4.2+
bits of entropy a character (random keys; not paths, model names or run names). A
``NAME=value`` assignment inside a string (``--env=HF_TOKEN=...``) is a secret when either
half is (:func:`secret_assignments`).

pydantic puts the offending input into every error (``input_value=...``; for a model-level
check, the whole mapping), so a config error is rebuilt with every secret value masked, in
the inputs and in the messages alike, before anyone sees it.
"""

from __future__ import annotations

import math
import re
import typing
from collections import Counter

from pydantic import BaseModel, SecretBytes, SecretStr, ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

MASK = "**********"
_SECRET_NAME = re.compile(
    r"(^|[_.-])(token|secret|password|passwd|apikey|pat|credentials?)($|[_.-])|(api|access|private)[_.-]key",
    re.IGNORECASE,
)
SECRET_TYPES = (SecretStr, SecretBytes)  # secret by type (BaseConfig.as_dict drops them)
# Providers' token shapes (GitHub, Hugging Face, OpenAI/Anthropic, Slack, GitLab, AWS access key ids, JWTs).
_KNOWN_TOKEN = re.compile(r"(ghp_|gho_|ghs_|ghu_|github_pat_|hf_|sk-|xox[abpr]-|glpat-|AKIA|ASIA|eyJ)[\w\-.]{12,}")
_WORD = re.compile(r"[A-Za-z0-9+/=_\-.~]+")
# NAME=value inside a string; NAME starts after anything but a name character.
# The value is what follows up to a space, ',' or ';', unless that is itself an assignment ('--env=NAME=x').
_ASSIGNMENT = re.compile(r"(?=(?<![A-Za-z0-9_.])([A-Za-z_][A-Za-z0-9_.-]*)=(?![A-Za-z_][A-Za-z0-9_.-]*=)([^\s,;]+))")
SECRET_ENTROPY_BITS = 4.2  # per character; random base62/64 keys of 20+ characters score 4.3-5.3


def is_secret_name(name: str) -> bool:
    """True when a key called ``name`` holds a secret by its name (see the module docstring)."""
    return _SECRET_NAME.search(name) is not None


def looks_like_secret(value: str) -> bool:
    """True when ``value`` looks like a key or token whatever it is called (see the module docstring)."""
    if _KNOWN_TOKEN.fullmatch(value):
        return True
    if len(value) < 20 or not _WORD.fullmatch(value) or value.startswith(("/", ".")):
        return False
    if not (any(c.isdigit() for c in value) and any(c.isalpha() for c in value)):
        return False
    counts = Counter(value)
    entropy = -sum(n / len(value) * math.log2(n / len(value)) for n in counts.values())
    return entropy >= SECRET_ENTROPY_BITS


def secret_assignments(text: str) -> list[tuple[str, str]]:
    """The ``NAME=value`` pairs inside ``text`` whose name or value is a secret (in order)."""
    found: dict[int, tuple[str, str]] = {}  # by where the value ends: '--hf-token=x' is one assignment, not two
    for match in _ASSIGNMENT.finditer(text):
        name, value = match.group(1), match.group(2)
        if value != MASK and (is_secret_name(name) or looks_like_secret(value)):
            found.setdefault(match.end(2), (name, value))
    return list(found.values())


def _secret_field(model: type[BaseModel] | None, name: str) -> bool:
    if model is None or name not in model.model_fields:
        return False
    annotation = model.model_fields[name].annotation
    return any(t in SECRET_TYPES for t in (annotation, *typing.get_args(annotation)))


def _submodel(model: type[BaseModel] | None, name: str) -> type[BaseModel] | None:
    if model is None or name not in model.model_fields:
        return None
    annotation = model.model_fields[name].annotation
    for t in (annotation, *typing.get_args(annotation)):
        if isinstance(t, type) and issubclass(t, BaseModel):
            return t
    return None


def secret_values(data: object, model: type[BaseModel] | None = None) -> set[str]:
    """Every secret string in ``data`` (a config mapping as given, validated against ``model``): the values
    under secret keys or fields, strings that look like secrets, and secret assignments' values in strings."""
    found: set[str] = set()
    if isinstance(data, str):
        found.update(value for _, value in secret_assignments(data))
        if looks_like_secret(data):
            found.add(data)
    elif isinstance(data, dict):
        for key, value in data.items():
            if isinstance(key, str) and (is_secret_name(key) or _secret_field(model, key)):
                found.update(_strings(value))
            else:
                found |= secret_values(value, _submodel(model, key) if isinstance(key, str) else None)
    elif isinstance(data, (list, tuple)):
        for value in data:
            found |= secret_values(value)
    return found


def _strings(value: object) -> set[str]:
    if isinstance(value, (SecretStr, SecretBytes)):
        value = value.get_secret_value()
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    if isinstance(value, str):
        return {value} if len(value) >= 4 else set()  # shorter ones would mask ordinary text
    if isinstance(value, dict):
        return {s for v in value.values() for s in _strings(v)}
    if isinstance(value, (list, tuple)):
        return {s for v in value for s in _strings(v)}
    return set()


def mask_text(text: str, secrets: set[str]) -> str:
    for secret in sorted(secrets, key=len, reverse=True):
        text = text.replace(secret, MASK)
    return text


def _mask_value(value: object, secrets: set[str]) -> object:
    if isinstance(value, str):
        return mask_text(value, secrets)
    if isinstance(value, dict):
        return {
            k: MASK if isinstance(k, str) and is_secret_name(k) else _mask_value(v, secrets) for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        return type(value)(_mask_value(v, secrets) for v in value)
    return value


def masked_error(exc: ValidationError, data: object, model: type[BaseModel]) -> ValidationError:
    """``exc`` with every secret of ``data`` masked in its inputs and messages (unchanged if none)."""
    secrets = secret_values(data, model)
    errors = exc.errors(include_url=False)
    leaked = any(isinstance(k, str) and is_secret_name(k) for e in errors for k in e["loc"])
    if not secrets and not leaked:
        return exc
    details: list[InitErrorDetails] = []
    for error in errors:
        secret_loc = any(isinstance(k, str) and is_secret_name(k) for k in error["loc"])
        value = MASK if secret_loc else _mask_value(error["input"], secrets)
        # Rebuilt as custom errors: pydantic formats the message from (type, message) and we
        # keep its type name, so the text reads as before, secrets masked.
        message = mask_text(error["msg"], secrets).replace("{", "{{").replace("}", "}}")
        details.append({"type": PydanticCustomError(error["type"], message), "loc": error["loc"], "input": value})
    return ValidationError.from_exception_data(exc.title, details)
