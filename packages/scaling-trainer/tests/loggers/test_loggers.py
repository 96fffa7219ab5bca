"""Sinks write what was logged; the W&B API key never lands in a file or an output."""

from __future__ import annotations

import json
import logging
import os
import re
import struct
import time
import uuid
from pathlib import Path

import pytest
import torch

from scaling.topology import Topology, TopologyConfig
from scaling.trainer.loggers import LoggerConfig, MetricsLogger, console_line

STEPS = {
    1: {"loss": 2.5, "learning_rate": 1e-3, "grad_norm": torch.tensor(0.75)},
    2: {"loss": 2.25, "learning_rate": 2e-3},
}


def _wandb_history(path: Path) -> list[dict]:
    """History rows of an offline ``.wandb`` file: a 7-byte header, then a LevelDB-style
    log (32 KiB blocks; records of crc32 u32, length u16, type u8 + payload) of protobufs."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, rows, buf = path.read_bytes(), 7, [], b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0 and length == 0:  # zero padding at the end of a block
            break
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            record = pb.Record.FromString(buf)
            if record.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return rows


def _all_text(root: Path) -> bytes:
    return b"".join(p.read_bytes() for p in root.rglob("*") if p.is_file())


def test_console_jsonl_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = MetricsLogger(LoggerConfig(log_dir=tmp_path, use_tensorboard=True))
    for step, metrics in STEPS.items():
        logger.log({"step": step, **metrics}, step)
    logger.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    run = lines[0].pop("run")
    assert re.fullmatch(r"\d{8}T\d{6}Z", run) and lines[1].pop("run") == run
    assert lines == [
        {"step": 1, "loss": 2.5, "learning_rate": 1e-3, "grad_norm": 0.75},
        {"step": 2, "loss": 2.25, "learning_rate": 2e-3},
    ]
    acc = EventAccumulator(str(tmp_path / "tensorboard")).Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 2.5), (2, 2.25)]
    assert acc.Scalars("grad_norm")[0].value == pytest.approx(0.75)
    assert console_line(1, {"grad_norm": 0.75, "loss": 2.5}) == "step 1 | grad_norm 0.75 | loss 2.5"


# What the trainer logs at a step (the keys of BaseTrainer.train_step's metrics).
TRAINER_STEP = {
    "training/loss": 2.2994, "training/accuracy": 0.0833, "training/global_grad_norm": 0.2128,
    "training/lr_weight_decay_params": 6e-4, "training/loss_scale": 1.0, "training/loss_spike": 0.0,
    "runtime/step_duration": 0.2201, "runtime/samples_per_second": 272.6, "runtime/tokens_per_second": 34893.1,
    "runtime/peak_memory_mib": 290.8, "runtime/mfu": 0.4912, "runtime/tflops_per_device": 485.8,
    "evaluation/loss": 2.292, "evaluation/accuracy": 0.1333,
}  # fmt: skip


def test_the_brief_console_line_says_where_the_run_is_in_120_characters():
    training = {k: v for k, v in TRAINER_STEP.items() if not k.startswith("evaluation")}
    line = console_line(20, training, total=300, eta_s=65.4, brief=True)
    assert line == (
        "step 20/300 | loss 2.299 | acc 0.0833 | lr 6.000e-04 | gnorm 0.2128 | tok/s 34893 | mfu 49.1% | eta 1m05s"
    )  # tokens/s stands for the throughput; s/step did not fit
    assert len("07:49:30 " + line) <= 120  # the logger's time stamp included
    crowded = console_line(20, TRAINER_STEP, total=300, eta_s=4000, brief=True)
    assert crowded.startswith("step 20/300 | loss 2.299 | acc 0.0833 | eval loss 2.292 | eval acc 0.1333 | lr ")
    assert crowded.endswith(" | eta 1h06m") and len("07:49:30 " + crowded) <= 120
    assert console_line(3, {"evaluation/loss": 2.292}, total=300, brief=True) == "step 3/300 | eval loss 2.292"
    full = console_line(20, TRAINER_STEP, total=300, brief=False)
    assert all(k in full for k in TRAINER_STEP)  # 'full': every metric


def test_the_console_counts_down_once_started():
    logger = MetricsLogger(LoggerConfig())
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger.logger.addHandler(handler)
    try:
        logger.start(10, 20)
        for step in (11, 12, 20):
            logger.log({"training/loss": 1.0}, step)
    finally:
        logger.logger.removeHandler(handler)
    messages = [r.getMessage() for r in records]
    assert [m.split(" | eta")[0] for m in messages] == [
        "step 11/20 | loss 1",
        "step 12/20 | loss 1",
        "step 20/20 | loss 1",
    ]
    assert [" | eta " in m for m in messages] == [True, True, False]


def test_a_resumed_run_replaces_the_rows_after_its_step(tmp_path):
    """A run that died after logging steps 1-3 and resumes from its step-2 checkpoint: the file
    keeps steps 1-2 of the first attempt, then the new attempt's 3-4, one row a step; TensorBoard
    hides the first attempt's step 3."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = MetricsLogger(LoggerConfig(log_dir=tmp_path, use_tensorboard=True))
    for step in (1, 2, 3):
        first.log({"loss": float(step)}, step)
    first.close()
    second = MetricsLogger(LoggerConfig(log_dir=tmp_path, use_tensorboard=True))
    for sink in second.sinks:  # the second attempt's id, told apart from the first's within one second
        if hasattr(sink, "run"):
            sink.run = "later"
    second.resumed_at(2)
    for step in (3, 4):
        second.log({"loss": 10.0 * step}, step)
    second.close()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]
    assert rows[0]["run"] == rows[1]["run"] != "later" and rows[2]["run"] == rows[3]["run"] == "later"
    acc = EventAccumulator(str(tmp_path / "tensorboard")).Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]


def test_only_rank_zero_writes(tmp_path):
    topo = Topology(TopologyConfig(world_size=2, model_parallel_size=2, global_batch_size=2, micro_batch_size=1), 1)
    logger = MetricsLogger(LoggerConfig(log_dir=tmp_path, use_tensorboard=True), topology=topo)
    logger.log({"loss": 1.0}, 1)
    logger.close()
    assert not any(tmp_path.iterdir())


def test_bad_input(tmp_path):
    logger = MetricsLogger(LoggerConfig(log_dir=tmp_path))
    with pytest.raises(ValueError, match=r"metric 'loss' is a tensor of shape \[2\]"):
        logger.log({"loss": torch.ones(2)}, 1)
    with pytest.raises(TypeError, match="metric 'x' has type list"):
        logger.log({"x": [1]}, 1)
    logger.close()
    with pytest.raises(ValueError, match="log_dir=None but use_tensorboard"):
        MetricsLogger(LoggerConfig(use_tensorboard=True))
    with pytest.raises(ValueError, match="wandb_mode"):
        LoggerConfig(wandb_mode="cloud")


@pytest.mark.slow
def test_wandb_offline_run_and_secret_never_written(tmp_path, monkeypatch, capfd):
    pytest.importorskip("wandb")
    sentinel = f"sentinel-{uuid.uuid4().hex}"  # a 40+ char key shaped like a real one
    monkeypatch.setenv("WANDB_API_KEY", sentinel)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = LoggerConfig(log_dir=tmp_path, use_wandb=True, use_tensorboard=True, wandb_mode="offline", wandb_project="t")
    logger = MetricsLogger(cfg, run_config=cfg.as_dict())
    for step, metrics in STEPS.items():
        logger.log(metrics, step)
    logger.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    # wandb's service process may still be flushing the run file after finish() returns on
    # a loaded machine: give it a few seconds (not a timing assertion).
    deadline, history = time.monotonic() + 20, []
    while time.monotonic() < deadline and len([h for h in history if "loss" in h]) < 2:
        history = _wandb_history(next(runs[0].glob("run-*.wandb")))
        time.sleep(0.2)
    assert [(h["_step"], h["loss"], h["learning_rate"]) for h in history if "loss" in h] == [
        (1, 2.5, 1e-3),
        (2, 2.25, 2e-3),
    ]
    assert [h["grad_norm"] for h in history if "grad_norm" in h] == [0.75]
    out, err = capfd.readouterr()
    assert sentinel.encode() not in _all_text(tmp_path)
    assert sentinel not in out + err
    assert sentinel not in json.dumps(cfg.as_dict())
    assert os.environ["WANDB_API_KEY"] == sentinel  # read from the environment only, untouched
