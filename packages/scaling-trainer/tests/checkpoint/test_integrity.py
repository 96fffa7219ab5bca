"""Atomicity, verification, fallback, keep-last-N and refusal of pickles (one process)."""

from __future__ import annotations

import json
import os
import pickle
import random
import sys
import warnings

import numpy as np
import pytest
import torch

from scaling.trainer.checkpoint import (
    CheckpointError,
    committed_steps,
    load_checkpoint,
    model_state_dict,
    save_checkpoint,
)

sys.path.insert(0, os.path.dirname(__file__))
from ckpt_helpers import build_params, full_tensors  # noqa: E402

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _state(fill=True, scale=1.0):
    params = build_params(0, 1, list(range(4)), fill=fill)
    return {"model": {k: v * scale for k, v in model_state_dict(params, None).items()}, "counter": 3}


def _save(path, step, scale=1.0, **kw):
    return save_checkpoint(path, step, _state(scale=scale), None, extra={"step": step}, **kw).wait()


def _load(path, **kw):
    return load_checkpoint(path, _state(fill=False), None, **kw)


def _shard(step_dir):
    return next(p for p in sorted(step_dir.iterdir()) if p.suffix == ".distcp")


def test_round_trip_scalars_extra_and_rank_state(tmp_path):
    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch_cpu": torch.get_rng_state()}
    save_checkpoint(tmp_path, 5, _state(), None, extra={"it": 5}, rank_state=rng).wait()
    loaded = _load(tmp_path)
    assert loaded.step == 5 and loaded.extra == {"it": 5} and loaded.state["counter"] == 3
    full = full_tensors()
    assert all(torch.equal(loaded.state["model"][k], full[k]) for k in full)
    back = loaded.rank_state
    assert back["python"] == rng["python"]
    assert all(
        np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b for a, b in zip(back["numpy"], rng["numpy"])
    )
    assert torch.equal(back["torch_cpu"], rng["torch_cpu"])


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_damaged_shard_names_the_file(tmp_path, damage):
    step_dir = _save(tmp_path, 1)
    shard = _shard(step_dir)
    if damage == "flip":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))
    elif damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:-10])
    else:
        shard.unlink()
    with pytest.raises(CheckpointError, match=shard.name):
        _load(tmp_path)


def test_garbled_latest_and_fallback(tmp_path):
    _save(tmp_path, 1)
    step2 = _save(tmp_path, 2, scale=2.0)
    (tmp_path / "latest").write_text("st\x00ep_???")
    with pytest.raises(CheckpointError, match="latest: garbled"):
        _load(tmp_path)
    assert _load(tmp_path, fallback_to_previous=True).step == 2  # newest committed still fine
    shard = _shard(step2)
    shard.write_bytes(shard.read_bytes()[:-1])
    (tmp_path / "latest").write_text("step_00000002\n")
    with pytest.raises(CheckpointError, match="truncated"):
        _load(tmp_path)
    loaded = _load(tmp_path, fallback_to_previous=True)
    assert loaded.step == 1 and loaded.skipped and "step_00000002" in loaded.skipped[0][1]
    assert torch.equal(loaded.state["model"]["layers.0.norm.weight"], full_tensors()["layers.0.norm.weight"])


@pytest.mark.parametrize(
    ("latest", "expected"),
    [
        (None, "latest does not exist: no committed checkpoint in"),
        ("step_00000009\n", "points to 'step_00000009', which is not a committed checkpoint"),
        ("\x00garbage", "garbled content"),
    ],
    ids=["missing", "uncommitted", "garbled"],
)
def test_bad_latest_pointer_names_the_file(tmp_path, latest, expected):
    # What every rank reports when the trainer's load_dir has no usable `latest`
    # (tests/reliability/test_runner_faults.py checks one of them end to end through the runner).
    (tmp_path / "step_00000009").mkdir()  # an uncommitted folder, as a crash leaves it
    if latest is not None:
        (tmp_path / "latest").write_text(latest)
    with pytest.raises(CheckpointError, match=str(tmp_path / "latest")) as err:
        _load(tmp_path)
    assert expected in str(err.value)


def test_uncommitted_folder_ignored_then_cleaned_and_keep_last(tmp_path):
    _save(tmp_path, 1)
    half = tmp_path / "step_00000009"
    half.mkdir()
    (half / "__0_0.distcp").write_bytes(b"partial")
    assert _load(tmp_path).step == 1 and committed_steps(tmp_path) == [1]
    with pytest.raises(CheckpointError, match="not a committed checkpoint"):
        _load(tmp_path, step=9)
    for step in (2, 3, 4):
        _save(tmp_path, step, keep_last=2)
    assert not half.exists()
    assert committed_steps(tmp_path) == [3, 4]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step_")) == [
        "step_00000003",
        "step_00000004",
    ]
    assert _load(tmp_path).step == 4


class _Evil:
    def __init__(self, sentinel):
        self.sentinel = sentinel

    def __reduce__(self):
        return (open, (self.sentinel, "w"))


def _rewrite_marker(step_dir, name):
    from scaling.trainer.checkpoint._marker import hash_file

    marker = json.loads((step_dir / "commit.json").read_text())
    marker["files"][name] = hash_file(step_dir / name)
    (step_dir / "commit.json").write_text(json.dumps(marker))


@pytest.mark.parametrize("target", [".metadata", "shard", "extra_file"])
@pytest.mark.parametrize("fix_marker", [False, True])
def test_malicious_pickle_is_refused(tmp_path, target, fix_marker):
    step_dir = _save(tmp_path / "ck", 1)
    sentinel = tmp_path / "pwned"
    payload = pickle.dumps(_Evil(str(sentinel)))
    name = {".metadata": ".metadata", "shard": _shard(step_dir).name, "extra_file": "model.pt"}[target]
    (step_dir / name).write_bytes(payload)
    if fix_marker:  # an attacker who can also rewrite commit.json
        _rewrite_marker(step_dir, name)
    if target == "extra_file" and fix_marker:
        _load(tmp_path / "ck")  # a listed file nobody reads is never opened, let alone unpickled
    else:
        with pytest.raises(CheckpointError) as info:
            _load(tmp_path / "ck")
        assert name in str(info.value) or "refused or corrupt" in str(info.value)
    assert not sentinel.exists()


def test_key_errors_and_regexes(tmp_path):
    _save(tmp_path, 1)
    template = _state(fill=False)
    template["model"]["layers.9.new.weight"] = torch.zeros(2)
    with pytest.raises(CheckpointError, match=r"missing from checkpoint .*layers\.9\.new\.weight"):
        load_checkpoint(tmp_path, template, None)
    loaded = load_checkpoint(tmp_path, template, None, allowed_missing=[r"model\.layers\.9\..*"])
    assert loaded.missing_keys == ["model.layers.9.new.weight"]
    small = {"model": {k: v for k, v in _state(fill=False)["model"].items() if k.startswith("layers.0.")}}
    with pytest.raises(CheckpointError, match="no rank expects.*model.layers.1.linear.bias"):
        load_checkpoint(tmp_path, small, None)
    ok = load_checkpoint(tmp_path, small, None, allowed_unexpected=[r"model\.layers\.[1-3]\..*", "counter"])
    assert "model.layers.3.norm.weight" in ok.unexpected_keys
    keep = torch.full((4,), 7.0)
    small["model"]["layers.0.norm.weight"] = keep
    load_checkpoint(tmp_path, small, None, ignored=[r"model\.layers\.[1-3]\..*", "counter", r".*norm.*"])
    assert torch.equal(keep, torch.full((4,), 7.0))
    bad = _state(fill=False)
    bad["model"]["layers.0.norm.weight"] = torch.zeros(5)
    with pytest.raises(CheckpointError, match=r"layers.0.norm.weight: checkpoint shape \[4\] != model shape \[5\]"):
        load_checkpoint(tmp_path, bad, None)


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="step=-1"):
        save_checkpoint(tmp_path, -1, _state(), None)
    with pytest.raises(ValueError, match="keep_last=0"):
        save_checkpoint(tmp_path, 1, _state(), None, keep_last=0)
    with pytest.raises(TypeError, match="extra must be JSON-able"):
        save_checkpoint(tmp_path, 1, _state(), None, extra={"x": object()})
    with pytest.raises(TypeError, match="'model.bad' has type object"):
        save_checkpoint(tmp_path, 1, {"model": {"bad": object()}}, None)
    _save(tmp_path, 1)
    with pytest.raises(ValueError, match="already a committed checkpoint"):
        _save(tmp_path, 1)
    with pytest.raises(CheckpointError, match="does not exist"):
        _load(tmp_path / "nothing")
