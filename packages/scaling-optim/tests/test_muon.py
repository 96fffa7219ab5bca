"""Muon (#53): against torch.optim.Muon on one process, then every layout against one process.

The model of ``optim_parity.py``: a column-parallel and a row-parallel matrix (Muon), a TP-split
bias, a replicated bias and a sequence-parallel scale (AdamW, as the recipe updates non-matrix
parameters); odd sizes, so ZeRO chunks are uneven and padded and the matrices' shards cut rows.
"""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from optim_parity import SCHED, SPECS, WEIGHT_DECAY, _check, _train, batches, forward, full_weights  # noqa: E402

from scaling.optim import LearningRateScheduler, MuonConfig, OptimizerConfig  # noqa: E402
from scaling.optim._update import adjusted_lr, newton_schulz  # noqa: E402
from scaling.testing import assert_parity, run_distributed  # noqa: E402

CLIP = 0.5
EXACT = {"muon": MuonConfig(ns_dtype="float32")}  # layouts agree to fp32 rounding


def _torch_reference(adjust_lr):
    """torch.optim.Muon on the matrices and torch.optim.AdamW on the rest, the full model, one process."""
    params = {n: torch.nn.Parameter(t.clone()) for n, t in full_weights().items()}
    matrices = [n for n in SPECS if len(SPECS[n][0]) == 2]
    muon = torch.optim.Muon(
        [{"params": [params[n]], "weight_decay": WEIGHT_DECAY[SPECS[n][3]], "name": SPECS[n][3]} for n in matrices],
        lr=0.0,
        adjust_lr_fn=adjust_lr,
    )
    adamw = torch.optim.AdamW(
        [
            {"params": [params[n]], "weight_decay": WEIGHT_DECAY[SPECS[n][3]], "name": SPECS[n][3]}
            for n in SPECS
            if n not in matrices
        ],
        lr=0.0,
        foreach=False,
    )
    schedules = {k: LearningRateScheduler(SCHED[k]) for k in SCHED}
    for step, (x, y) in enumerate(batches(), start=1):
        for opt in (muon, adamw):
            opt.zero_grad()
        torch.nn.functional.mse_loss(forward(params, x), y).backward()
        torch.nn.utils.clip_grad_norm_(list(params.values()), CLIP)
        for opt in (muon, adamw):
            for group in opt.param_groups:
                group["lr"] = schedules[group["name"]].get_lr(step)
            opt.step()
    return {n: p.detach() for n, p in params.items()}


@pytest.mark.distributed
@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon arrived in torch 2.9")
@pytest.mark.parametrize("adjust_lr", ["original", "match_rms_adamw"])
def test_one_process_equals_torch_muon_with_adamw_for_the_vectors(adjust_lr):
    """Five steps with clipping, a cosine schedule and weight decay: within 1e-6 of torch's Muon
    (bfloat16 Newton-Schulz, as torch's) for the matrices and AdamW for the rest."""
    expected = _torch_reference(adjust_lr)
    config = {"muon": MuonConfig(adjust_lr=adjust_lr)}
    ((params, _, _),) = run_distributed(_train, 1, 1, 0, "muon", CLIP, timeout_seconds=60, **config)
    for name in SPECS:
        assert_parity(params[name], expected[name], rtol=1e-6, atol=1e-8, name=name)
    assert not torch.equal(params["layers.0.fc1.weight"], full_weights()["layers.0.fc1.weight"])  # it moved


def test_newton_schulz_orthogonalises():
    """The quintic iteration's singular values land in about (0.68, 1.13) (Keller Jordan's note:
    not exactly 1, by design), for wide and tall matrices alike, in float32."""
    g = torch.Generator().manual_seed(0)
    for shape in ((16, 48), (48, 16)):
        ortho = newton_schulz(torch.randn(shape, generator=g), MuonConfig(ns_dtype="float32"))
        values = torch.linalg.svdvals(ortho)
        assert ortho.shape == shape and ortho.dtype == torch.float32
        assert 0.6 < values.min() and values.max() < 1.2, values
    assert adjusted_lr(0.1, (4, 16), MuonConfig(adjust_lr="match_rms_adamw")) == pytest.approx(0.1 * 0.2 * 4)
    assert adjusted_lr(0.1, (16, 4), MuonConfig(adjust_lr="original")) == pytest.approx(0.2)
    assert adjusted_lr(0.1, (4, 16), MuonConfig(adjust_lr="none")) == 0.1


@pytest.mark.distributed
@pytest.mark.parametrize(("tp", "world", "zero"), [(1, 2, 1), (1, 2, 3), (2, 2, 2), (2, 4, 0), (2, 4, 1), (2, 4, 3)])
def test_every_layout_equals_one_process(tp, world, zero):
    """dp×tp with every ZeRO stage: each matrix is gathered whole (ZeRO shards, then TP pieces),
    orthogonalised and cut back; five steps equal one process within 1e-5."""
    ((expected, expected_norms, _),) = run_distributed(_train, 1, 1, 0, "muon", CLIP, timeout_seconds=60, **EXACT)
    results = run_distributed(_train, world, tp, zero, "muon", CLIP, timeout_seconds=180, **EXACT)
    _check(results, expected, tp, rtol=1e-5)
    assert_parity(results[0][1], expected_norms, rtol=1e-5, name="gradient norms")


@pytest.mark.distributed
def test_a_muon_checkpoint_resumes_at_another_layout(tmp_path):
    """Three steps at dp2·tp2 ZeRO-1 saved with DCP (momentum buffers as DTensors of their logical
    shapes), two more at dp2 ZeRO-3: the five equal one process's (1e-5)."""
    ((expected, _, _),) = run_distributed(_train, 1, 1, 0, "muon", CLIP, timeout_seconds=60, **EXACT)
    path = str(tmp_path / "ckpt")
    run_distributed(_train, 4, 2, 1, "muon", CLIP, steps=3, save_to=path, timeout_seconds=180, **EXACT)
    results = run_distributed(_train, 2, 1, 3, "muon", CLIP, start=3, load_from=path, timeout_seconds=60, **EXACT)
    _check(results, expected, 1, rtol=1e-5)


def test_muon_with_cpu_offload_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match=r"method='muon' with cpu_offload=True.*set cpu_offload=False"):
        OptimizerConfig(method="muon", cpu_offload=True)
