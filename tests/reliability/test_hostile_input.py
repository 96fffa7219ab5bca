"""Hostile files: a pickle payload in any checkpoint file we load, or a YAML tag in a config, never runs."""

from __future__ import annotations

import hashlib
import json
import pickle
import warnings

import pytest
import torch
from pydantic import BaseModel

from scaling.config import BaseConfig
from scaling.trainer.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


class _Evil:
    def __init__(self, sentinel: str) -> None:
        self.sentinel = sentinel

    def __reduce__(self):
        return (open, (self.sentinel, "w"))


def _state(fill: bool = True) -> dict:
    w = torch.arange(12.0) if fill else torch.zeros(12)
    return {"model": {"w": w}, "counter": 3}


def _files(step_dir):
    return sorted(p.relative_to(step_dir).as_posix() for p in step_dir.rglob("*") if p.is_file())


def test_pickle_payload_in_every_checkpoint_file_is_refused(tmp_path):
    rank_state = {"rng": torch.get_rng_state(), "python": [1, 2]}
    step_dir = save_checkpoint(tmp_path / "ck0", 1, _state(), None, extra={"it": 1}, rank_state=rank_state).wait()
    names = _files(step_dir)
    # commit.json, .metadata, the DCP shard, extra.json, scalars.json, the rank's json and safetensors
    assert len(names) >= 7, names
    for i, name in enumerate(names):
        ck = tmp_path / f"ck{i + 1}"
        target = save_checkpoint(ck, 1, _state(), None, extra={"it": 1}, rank_state=rank_state).wait()
        sentinel = tmp_path / f"pwned{i}"
        payload = pickle.dumps(_Evil(str(sentinel)))
        (target / name).write_bytes(payload)
        if name != "commit.json":  # an attacker who can also rewrite the marker's hashes
            marker = json.loads((target / "commit.json").read_text())
            marker["files"][name] = {"size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
            (target / "commit.json").write_text(json.dumps(marker))
        # Loading refuses it with a CheckpointError naming the checkpoint folder (and, for
        # the files we parse ourselves, the file).
        with pytest.raises(CheckpointError, match="step_00000001"):
            load_checkpoint(ck, _state(fill=False), None)
        assert not sentinel.exists(), f"payload in {name} ran"


class _Cfg(BaseConfig):
    _require_descriptions = False

    class Inner(BaseModel):
        x: str = "a"

    name: str = "x"


@pytest.mark.parametrize(
    "yaml_text",
    [
        "name: !!python/object/apply:os.system ['touch {sentinel}']\n",
        "name: !!python/object/new:subprocess.Popen [['touch', '{sentinel}']]\n",
    ],
)
def test_yaml_config_with_python_tags_is_refused(tmp_path, yaml_text):
    sentinel = tmp_path / "pwned"
    path = tmp_path / "config.yml"
    path.write_text(yaml_text.format(sentinel=sentinel))
    with pytest.raises(Exception, match="python/object") as info:
        _Cfg.from_yaml(path)
    assert not isinstance(info.value, SystemExit)
    assert not sentinel.exists()
