"""Which environment variables travel to the workers, and which of them are secrets.

A variable is a secret by its name (scaling.config's rule: a word ``token``, ``secret``,
``password``, ``pat``, ``credentials``... or ``api_key``/``access_key``/``private_key``;
for variables also any name matching :data:`SECRET_PATTERNS`, e.g. ``*_KEY``) or by its
value (a provider's token shape or a random-looking key, whatever the name). Secrets
travel only as environment variables of the processes the runner starts (or by name:
``docker run -e NAME``, ``ssh -o SendEnv=NAME``); their values never appear in an argument
list, a generated script, a dry-run print or the payload file.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping

from scaling.config import is_secret_name, looks_like_secret, secret_assignments

# Environment-variable names that hold secrets beyond scaling.config's word rule (which also
# judges payload keys, where 'text_key' or 'cache_key' are plain).
SECRET_PATTERNS: tuple[str, ...] = ("*_KEY", "*_KEY_ID", "*_AUTH", "*_AUTH_*")
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
MASK = "***"


def is_secret(name: str, value: str | None = None) -> bool:
    """True when the variable ``name`` (holding ``value``, when given) is a secret: by its name,
    or by a value that looks like a key or token (see the module docstring)."""
    upper = name.upper()
    return (
        is_secret_name(name)
        or any(fnmatch.fnmatchcase(upper, pattern) for pattern in SECRET_PATTERNS)
        or (value is not None and looks_like_secret(value))
    )


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
    plain = {k: v for k, v in env.items() if not is_secret(k, v)}
    secret = {k: v for k, v in env.items() if is_secret(k, v)}
    return plain, secret


def mask_env(env: Mapping[str, str]) -> dict[str, str]:
    """A copy of ``env`` with every secret value replaced by ``***`` (for printing)."""
    return {k: (MASK if is_secret(k, v) else v) for k, v in env.items()}


def check_args(args: list[str], field: str, by_value: bool = True) -> list[str]:
    """Refuse command-line items that assign a secret (``--env=HF_TOKEN=...``): a command line is
    visible to every user of the machine (``ps``). The error names the item and the variable, never the value.
    ``by_value=False`` judges assignments by their names only (a script's own arguments)."""
    for i, arg in enumerate(args):
        for name, _ in secret_assignments(arg):
            if by_value or is_secret_name(name):
                raise ValueError(
                    f"{field}[{i}] assigns {name!r} a secret value on a command line, where `ps` shows it to "
                    f"every user of the node; export {name if _NAME_RE.fullmatch(name) else 'it'} in the launching "
                    f"environment and list it in runner.env_forward (it then travels by name only)"
                )
    return args


def find_secret_keys(payload: object, prefix: str = "") -> list[str]:
    """Dotted keys of ``payload`` that look like secrets and hold a non-empty value."""
    found: list[str] = []
    if isinstance(payload, Mapping):
        for key, value in payload.items():
            dotted = f"{prefix}.{key}" if prefix else str(key)
            if is_secret_name(str(key)) and value not in (None, "", "**********"):
                found.append(dotted)
            else:
                found.extend(find_secret_keys(value, dotted))
    elif isinstance(payload, (list, tuple)):
        for i, value in enumerate(payload):
            found.extend(find_secret_keys(value, f"{prefix}[{i}]"))
    return found
