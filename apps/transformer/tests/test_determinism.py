"""``trainer.deterministic``: torch's deterministic kernels, chosen before the model is built.

On CPU the kernels are deterministic already, so the switch must change nothing there: the
same bits as without it, on a layout that exercises the paths with atomic additions on GPUs
(embedding, the experts' index gathers, attention) and with dropout under activation
checkpointing. That a CUDA run then repeats bit for bit is the `gpu` tier's
(`tests/gpu/test_cuda.py::test_deterministic_runs_on_cuda_repeat_bit_for_bit`).
"""

import pytest
import torch
from transformer_testlib import losses, tiny_config

from scaling.testing import run_distributed
from scaling.topology import use_deterministic_algorithms
from scaling.transformer import train


def _worker(cfg):
    # train.main, not train_worker: the switches are read before they are turned off again.
    try:
        history = train.main(cfg)
        return history, torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic
    finally:
        use_deterministic_algorithms(False)  # the pooled worker runs other tests next


MOE_AC_DROPOUT = {
    "moe": {"num_experts": 4, "top_k": 2},
    "activation_checkpointing": "every_layer",
    "attention_dropout": 0.1,
    "hidden_dropout": 0.1,
}


@pytest.mark.distributed
@pytest.mark.parametrize(
    "arch, optimizer",
    [(MOE_AC_DROPOUT, {}), ({}, {"zero_stage": 3})],  # ZeRO-3: padded shards, where filled empties would show
    ids=["moe-ac-dropout", "zero3"],
)
def test_deterministic_changes_no_bit_on_cpu(tiny_corpus, arch, optimizer):
    runs = {}
    for deterministic in (False, True):
        cfg = tiny_config(tiny_corpus, dp=2, steps=4, trainer={"deterministic": deterministic}, optimizer=optimizer)
        cfg["transformer_architecture"].update(arch)
        runs[deterministic] = run_distributed(_worker, 2, cfg)
    for rank in range(2):
        (plain, *flags_off), (chosen, *flags_on) = runs[False][rank], runs[True][rank]
        assert flags_off == [False, False] and flags_on == [True, True]
        for key in ("training/loss", "training/global_grad_norm"):
            assert losses(chosen, key) == losses(plain, key)
