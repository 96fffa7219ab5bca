"""Which environment variables travel to the workers, and which of them are secrets.

Secrets travel only as environment variables of the processes the runner starts (or by
name: ``docker run -e NAME``, ``ssh -o SendEnv=NAME``); their values never appear in an
argument list, a generated script, a dry-run print or the payload file.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping

# A bare name counts too: a payload key ``api_key`` is as secret as ``wandb_api_key``.
SECRET_PATTERNS: tuple[str, ...] = (
    "WANDB_API_KEY", "API_KEY", "*_API_KEY", "TOKEN", "*_TOKEN", "PASSWORD", "*_PASSWORD", "SECRET", "*_SECRET",
)  # fmt: skip
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
MASK = "***"


def is_secret(name: str) -> bool:
    """True when the variable ``name`` holds a secret (matches :data:`SECRET_PATTERNS`)."""
    upper = name.upper()
    return any(fnmatch.fnmatchcase(upper, pattern) for pattern in SECRET_PATTERNS)


def check_env_name(name: str, field: str) -> str:
    """Return ``name`` if it is a valid environment variable name, else raise ``ValueError``."""
    if not _NAME_RE.fullmatch(name):
        raise ValueError(f"{field}: {name!r} is not an environment variable name; use [A-Za-z_][A-Za-z0-9_]*")
    return name


def check_env_pattern(pattern: str, field: str) -> str:
    """Allow-list entries are names with optional ``*`` wildcards (``NCCL_*``)."""
    if not _NAME_RE.fullmatch(pattern.replace("*", "X")):
        raise ValueError(f"{field}: {pattern!r} is not a variable name or a 'PREFIX_*' pattern")
    return pattern


def select_forwarded(environ: Mapping[str, str], patterns: list[str]) -> dict[str, str]:
    """The variables of ``environ`` whose names match one of ``patterns`` (sorted by name)."""
    return {k: environ[k] for k in sorted(environ) if any(fnmatch.fnmatchcase(k, p) for p in patterns)}


def split_secrets(env: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """Split ``env`` into ``(plain, secret)`` dicts."""
    plain = {k: v for k, v in env.items() if not is_secret(k)}
    secret = {k: v for k, v in env.items() if is_secret(k)}
    return plain, secret


def mask_env(env: Mapping[str, str]) -> dict[str, str]:
    """A copy of ``env`` with every secret value replaced by ``***`` (for printing)."""
    return {k: (MASK if is_secret(k) else v) for k, v in env.items()}


def find_secret_keys(payload: object, prefix: str = "") -> list[str]:
    """Dotted keys of ``payload`` that look like secrets and hold a non-empty value."""
    found: list[str] = []
    if isinstance(payload, Mapping):
        for key, value in payload.items():
            dotted = f"{prefix}.{key}" if prefix else str(key)
            if is_secret(str(key)) and value not in (None, "", "**********"):
                found.append(dotted)
            else:
                found.extend(find_secret_keys(value, dotted))
    elif isinstance(payload, (list, tuple)):
        for i, value in enumerate(payload):
            found.extend(find_secret_keys(value, f"{prefix}[{i}]"))
    return found
