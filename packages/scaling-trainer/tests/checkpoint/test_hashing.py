"""Digests taken while writing equal the files on disk; untrusted digests are re-hashed."""

from __future__ import annotations

import json
import warnings

import torch

from scaling.trainer.checkpoint import _marker as mk
from scaling.trainer.checkpoint import _save, load_checkpoint, save_checkpoint
from scaling.trainer.checkpoint._hashing_writer import HashingFileSystem, write_file_hashed
from scaling.trainer.checkpoint._save import _commit, _trusted

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _big_state() -> dict:
    gen = torch.Generator().manual_seed(0)
    # Two tensors, 64 KiB in all: with split_bytes lowered below, DCP writes two shard files.
    return {"model": {"a": torch.randn(8192, generator=gen), "b": torch.randn(8192, generator=gen)}, "n": 1}


def test_marker_digests_match_disk(tmp_path, monkeypatch):
    monkeypatch.setattr(_save, "_SPLIT_BYTES", 1 << 10)
    rank_state = {"rng": torch.get_rng_state(), "t": (1, 2)}
    step_dir = save_checkpoint(tmp_path, 4, _big_state(), None, extra={"x": 1}, rank_state=rank_state).wait()
    marker = json.loads((step_dir / mk.MARKER).read_text())
    names = mk.list_files(step_dir)
    assert sorted(marker["files"]) == names
    assert {"__0_0.distcp", "__0_1.distcp", ".metadata", "extra.json", "scalars.json"} <= set(names)
    for name in names:
        assert marker["files"][name] == mk.hash_file(step_dir / name), name
    template = {"model": {"a": torch.zeros(8192), "b": torch.zeros(8192)}, "n": 0}
    loaded = load_checkpoint(tmp_path, template, None)
    assert torch.equal(template["model"]["a"], _big_state()["model"]["a"]) and loaded.state["n"] == 1


def test_small_write_is_one_shard_file(tmp_path):
    step_dir = save_checkpoint(tmp_path, 1, {"model": {"w": torch.ones(4), "v": torch.ones(2)}}, None).wait()
    assert [n for n in mk.list_files(step_dir) if n.endswith(".distcp")] == ["__0_0.distcp"]


def test_seeked_stream_has_no_digest(tmp_path):
    fs = HashingFileSystem()
    with fs.create_stream(tmp_path / "plain", "wb") as f:
        f.write(b"abc")
    with fs.create_stream(tmp_path / "seeked", "wb") as f:
        f.write(b"abc")
        f.seek(0)
        f.write(b"x")
    fs.rename(tmp_path / "plain", tmp_path / "moved")
    assert fs.digests == {tmp_path / "moved": mk.hash_file(tmp_path / "moved")}


def test_commit_rehashes_missing_and_stale_digests(tmp_path):
    step_dir = tmp_path / mk.step_dir_name(2)
    (step_dir / "ranks").mkdir(parents=True)
    good = write_file_hashed(step_dir / "good.json", "{}")
    write_file_hashed(step_dir / "stale.bin", b"12345")
    (step_dir / "unknown.bin").write_bytes(b"zz")
    known = {"good.json": good, "stale.bin": {"size": 3, "sha256": "0" * 64}, "gone.bin": good}
    assert _trusted(step_dir, known) == {"good.json": good}
    _commit(tmp_path, step_dir, 2, {"world_size": 1}, None, None, known)
    marker = json.loads((step_dir / mk.MARKER).read_text())
    assert marker["files"] == {n: mk.hash_file(step_dir / n) for n in ("good.json", "stale.bin", "unknown.bin")}
    assert mk.committed_steps(tmp_path) == [2]
