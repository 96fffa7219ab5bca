"""A name for torch's compile cache where the user has none (containers started with ``--user``).

torch 2.11 and older name the inductor cache directory after ``getpass.getuser()`` the first
time ``torch._dynamo`` is imported (DTensor and ``torch.compile`` import it), and that raises
``KeyError: 'getpwuid(): uid not found'`` where the process's uid has no passwd entry and no
``LOGNAME``/``USER`` is set: a container run with ``--user`` or from an image without
``/etc/passwd``. Newer torch falls back to ``uid_<uid>``; :func:`name_compile_cache` does the
same on older ones before the process group starts, and leaves a set directory alone.
"""

from __future__ import annotations

import getpass
import os
import tempfile


def name_compile_cache() -> None:
    """Set ``TORCHINDUCTOR_CACHE_DIR`` to torch's own fallback when this process has no user name."""
    if "TORCHINDUCTOR_CACHE_DIR" in os.environ:
        return
    try:
        getpass.getuser()
    except (KeyError, OSError):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), f"torchinductor_uid_{os.getuid()}")
