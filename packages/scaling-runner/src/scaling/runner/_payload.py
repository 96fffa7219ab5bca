"""The payload: a JSON-able dict (usually ``config.as_dict()``) that reaches every process.

The runner hands it over in one of two environment variables:

- ``SCALING_PAYLOAD_PATH``: path of a JSON file (local and SLURM runs; the file must be
  visible to every node, which a SLURM cluster's shared filesystem provides);
- ``SCALING_PAYLOAD``: the JSON itself, base64-encoded (pdsh runs, where no file is copied
  to the nodes).
"""

from __future__ import annotations

import base64
import json
import os
import sys
import types
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from scaling.runner._failures import REPORTED_ENV

if TYPE_CHECKING:
    from scaling.config import JsonDict, JsonMapping

PAYLOAD_PATH_ENV = "SCALING_PAYLOAD_PATH"
PAYLOAD_INLINE_ENV = "SCALING_PAYLOAD"
# One argv string is limited to 128 KiB on Linux (MAX_ARG_STRLEN); stay well below.
MAX_INLINE_BYTES = 96 * 1024


def dump_payload(payload: JsonMapping) -> str:
    """Serialise ``payload`` to JSON after checking that it carries no secret values."""
    from scaling.runner._env import find_secret_keys  # here: workers (load_payload) never import pydantic

    if not isinstance(payload, Mapping):
        raise TypeError(f"payload must be a dict (e.g. config.as_dict()), got {type(payload).__name__}")
    leaked = find_secret_keys(payload)
    if leaked:
        raise ValueError(
            f"payload holds secret-looking keys {leaked}; secrets must not be written to the payload file. "
            f"Declare them as pydantic SecretStr (as_dict() drops them) and pass the values through the environment"
        )
    try:
        return json.dumps(payload, sort_keys=True)
    except TypeError as exc:
        raise TypeError(f"payload must be JSON-serialisable (use config.as_dict()): {exc}") from None


def write_payload(text: str, directory: str | Path) -> Path:
    """Write the payload JSON to ``directory/payload.json`` (readable by the owner only)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    path = d / "payload.json"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path.resolve()


def inline_payload(text: str) -> str:
    """Base64 of the payload JSON, for ``SCALING_PAYLOAD``; raises when too large for one argument."""
    encoded = base64.b64encode(text.encode()).decode()
    if len(encoded) > MAX_INLINE_BYTES:
        raise ValueError(
            f"payload is {len(encoded)} bytes encoded, over the {MAX_INLINE_BYTES}-byte limit for passing it inline "
            f"to pdsh nodes; set runner.payload_dir to a directory on a filesystem shared by all nodes"
        )
    return encoded


def quiet_reported_errors() -> None:
    """In a worker of ``scaling.runner.torchrun``: an uncaught exception that the worker's error file
    records (its entry point wrapped by torchelastic's ``record``) prints no traceback here, since
    the runner prints each distinct error once with the first failure's traceback. Any other
    exception prints as usual. Installed once, by :func:`load_payload`; elsewhere it does nothing.
    """
    if os.environ.get(REPORTED_ENV) != "1" or getattr(sys.excepthook, "_scaling_quiet", False):
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: types.TracebackType | None) -> None:
        error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
        if not (error_file and os.path.isfile(error_file) and os.path.getsize(error_file) > 0):
            previous(kind, value, tb)

    hook._scaling_quiet = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def load_payload(environ: Mapping[str, str] | None = None) -> JsonDict:
    """Read the payload handed to this process by :func:`runner_main` (worker side).

    Args:
        environ: the environment to read; ``None`` means ``os.environ``.

    Returns:
        The dict given to ``runner_main(config, payload=...)``.

    Raises:
        RuntimeError: when this process was not started by the Scaling runner.

    Example::

        from scaling.runner import load_payload
        config = MyConfig.from_dict(load_payload())
    """
    env = os.environ if environ is None else environ
    if environ is None:
        quiet_reported_errors()
    if PAYLOAD_PATH_ENV in env:
        return json.loads(Path(env[PAYLOAD_PATH_ENV]).read_text())
    if PAYLOAD_INLINE_ENV in env:
        return json.loads(base64.b64decode(env[PAYLOAD_INLINE_ENV]).decode())
    raise RuntimeError(
        f"no payload: neither {PAYLOAD_PATH_ENV} nor {PAYLOAD_INLINE_ENV} is set; "
        f"start this script with scaling-run / runner_main instead of running it directly"
    )
