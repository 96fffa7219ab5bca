"""torch <= 2.11 cannot name its compile cache for a uid without a passwd entry; the topology names it first."""

import getpass
import os
import tempfile

from scaling.topology._compile_cache import name_compile_cache


def _no_user():
    raise KeyError("getpwuid(): uid not found: 1234")


def test_a_process_without_a_user_name_gets_torchs_own_fallback(monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")  # restored (absent) after the test
    monkeypatch.setattr(getpass, "getuser", _no_user)
    name_compile_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == os.path.join(
        tempfile.gettempdir(), f"torchinductor_uid_{os.getuid()}"
    )


def test_a_user_name_or_a_chosen_directory_is_left_alone(monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    name_compile_cache()  # this process has a user name: torch names the directory itself
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/chosen")
    monkeypatch.setattr(getpass, "getuser", _no_user)
    name_compile_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/chosen"
