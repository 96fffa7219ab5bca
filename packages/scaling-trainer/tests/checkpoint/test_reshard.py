"""Save at one (dp, tp, pp) layout, load at another and in one process: bitwise equal."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from scaling.testing import make_topology, run_distributed
from scaling.topology import get_rng_state
from scaling.trainer.checkpoint import (
    StagingBuffers,
    load_checkpoint,
    load_model_state_dict,
    model_state_dict,
    new_checkpoint_group,
    save_checkpoint,
)

sys.path.insert(0, os.path.dirname(__file__))
from ckpt_helpers import build_params, full_tensors, optimizer_state, stage_layers  # noqa: E402

TIMEOUT = 240  # the first call also starts the pooled workers, slow on a loaded machine


def _state(topo, fill: bool):
    layers = stage_layers(topo.axis("pp").rank, topo.axis("pp").size)
    params = build_params(topo.axis("tp").rank, topo.axis("tp").size, layers, fill=fill)
    return params, {"model": model_state_dict(params, topo), "optimizer": optimizer_state(params, topo, fill=fill)}


def save_at(path: str, step: int, tp: int, pp: int, use_async: bool) -> None:
    topo = make_topology(model_parallel_size=tp, pipe_parallel_size=pp)
    params, state = _state(topo, fill=True)
    group = new_checkpoint_group() if use_async else None
    rng = get_rng_state()
    staging = StagingBuffers() if use_async else None  # DTensors staged into kept buffers
    pending = save_checkpoint(
        path,
        step,
        state,
        topo,
        extra={"iterations": step},
        rank_state=rng,
        async_save=use_async,
        process_group=group,
        staging=staging,
    )
    if use_async:
        # The tensors were staged to CPU before save_checkpoint returned: changing them now
        # must not change what is written.
        with torch.no_grad():
            for _, p, _ in params:
                p.add_(100.0)
    pending.wait()


def load_at(path: str, tp: int, pp: int) -> dict:
    topo = make_topology(model_parallel_size=tp, pipe_parallel_size=pp)
    params, template = _state(topo, fill=False)
    loaded = load_checkpoint(path, template, topo)
    load_model_state_dict(params, loaded.state["model"])
    model = {k: v.full_tensor() for k, v in loaded.state["model"].items()}
    # the parameters themselves now hold this rank's shard of the saved values
    for name, p, meta in params:
        expect = model[meta.key]
        if meta.is_model_parallel:
            expect = expect.chunk(tp, meta.parallel_dim)[topo.axis("tp").rank]
        assert torch.equal(p.detach(), expect), name
    exp_avg = {k: v["exp_avg"].full_tensor() for k, v in loaded.state["optimizer"]["state"].items()}
    return {
        "model": model,
        "exp_avg": exp_avg,
        "step": loaded.state["optimizer"]["step"],
        "extra": loaded.extra,
        "has_rank_state": loaded.rank_state is not None,
    }


def _check(results: list[dict], step: int) -> None:
    full = full_tensors()
    seen: set[str] = set()
    for r in results:
        for k, v in r["model"].items():
            assert torch.equal(v, full[k]), k
            assert torch.equal(r["exp_avg"][k], full[k] * 2), k
            seen.add(k)
        assert r["step"] == 7 and r["extra"] == {"iterations": step}
    assert seen == set(full)


def _load_one_process(path: str, step: int) -> None:
    params = build_params(0, 1, list(range(4)), fill=False)
    template = {"model": model_state_dict(params, None), "optimizer": optimizer_state(params, None, fill=False)}
    loaded = load_checkpoint(path, template, None)
    load_model_state_dict(params, loaded.state["model"])
    full = full_tensors()
    for name, p, _ in params:
        assert torch.equal(p.detach(), full[name]), name
    assert loaded.step == step and loaded.rank_state is None  # world size changed: no RNG restore


@pytest.mark.distributed
@pytest.mark.slow
def test_dp2_tp2_to_pp2_and_one_process(tmp_path):
    run_distributed(save_at, 4, str(tmp_path), 3, 2, 1, True, timeout_seconds=TIMEOUT)
    out = run_distributed(load_at, 4, str(tmp_path), 1, 2, timeout_seconds=TIMEOUT)
    _check(out, 3)
    assert all(r["has_rank_state"] for r in out)  # same world size: RNG states come back
    _load_one_process(str(tmp_path), 3)


@pytest.mark.distributed
@pytest.mark.slow
def test_dp4_to_tp2_pp2_and_back(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    run_distributed(save_at, 4, str(a), 1, 1, 1, False, timeout_seconds=TIMEOUT)
    _check(run_distributed(load_at, 4, str(a), 2, 2, timeout_seconds=TIMEOUT), 1)
    run_distributed(save_at, 4, str(b), 2, 2, 2, False, timeout_seconds=TIMEOUT)
    _check(run_distributed(load_at, 4, str(b), 1, 1, timeout_seconds=TIMEOUT), 2)
