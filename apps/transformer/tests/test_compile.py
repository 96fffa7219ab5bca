"""Regional compilation of the transformer app (``training.compile``): compiled runs equal eager ones.

Each layout runs 10 steps compiled and is held to the eager one-process run of the same
model within 1e-5 relative per step (fp32; every eager layout matches it, see
test_parity.py). Inductor (C++ on CPU) compiles the ZeRO-3 run; the other layouts use the
``aot_eager`` backend, which runs the same Dynamo capture, graph breaks at the collectives
and AOTAutograd forward/backward split, without code generation: the composition is what
these test, at a fraction of CI's compile time (inductor's code: the ZeRO-3 case here and
bench/compile_step.py).
"""

import pytest
import torch
from torch.torch_version import TorchVersion
from transformer_testlib import losses, tiny_config, train_worker

from scaling.nn import float8_supported
from scaling.testing import assert_parity, run_distributed

STEPS = 10
LORA = {"method": "lora", "rank": 4}


def _reference(corpus, finetuning=None, arch=None):
    cfg = tiny_config(corpus, steps=STEPS, finetuning=finetuning or {})
    cfg["transformer_architecture"].update(arch or {})
    (history,) = run_distributed(train_worker, 1, cfg, timeout_seconds=120)
    return losses(history)


MOE = {"moe": {"every": 2, "num_experts": 4, "top_k": 2, "num_shared_experts": 1}}


@pytest.fixture(scope="module")
def eager_losses(tiny_corpus):
    return {
        "none": _reference(tiny_corpus),
        "lora": _reference(tiny_corpus, LORA),
        "moe": _reference(tiny_corpus, arch=MOE),
    }


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(
    ("sizes", "world", "backend", "ac", "variant"),
    [
        ({"dp": 2, "tp": 2}, 4, "aot_eager", False, "none"),
        ({"pp": 2, "dp": 2, "optimizer": {"zero_stage": 1}}, 4, "aot_eager", True, "none"),
        ({"dp": 2, "pp": 2, "tp": 2}, 8, "aot_eager", True, "lora"),
        pytest.param(
            {"dp": 2, "optimizer": {"zero_stage": 3}},
            2,
            "inductor",
            False,
            "none",
            marks=pytest.mark.skipif(
                TorchVersion(torch.__version__) < "2.7",
                reason="torch 2.6's CPU inductor drifts from eager (step 2: 3e-5, step 3: 1.6e-4, ZeRO-3 or not)",
            ),
        ),
        ({"cp": 2}, 2, "aot_eager", False, "none"),  # ring attention at graph breaks
        ({"dp": 2, "topology": {"expert_parallel_size": 2}}, 2, "aot_eager", False, "moe"),
        ({"tp": 2}, 2, "aot_eager", "operators", "none"),  # per-operator checkpointing's policy traced
    ],
    ids=[
        "dp2-tp2-sp",
        "pp2-dp2-zero1-ac",
        "dp2-pp2-tp2-sp-ac-lora",
        "dp2-zero3-inductor",
        "cp2",
        "dp2-ep2-moe",
        "tp2-sp-ops",
    ],
)
def test_compiled_run_matches_eager(tiny_corpus, eager_losses, sizes, world, backend, ac, variant):
    cfg = tiny_config(tiny_corpus, steps=STEPS, training={"compile": {"enabled": True, "backend": backend}}, **sizes)
    cfg["transformer_architecture"].update(
        sequence_parallel="tp" in sizes, activation_checkpointing={True: "every_layer", False: "none"}.get(ac, ac)
    )
    if variant == "lora":
        cfg["finetuning"] = LORA
    if variant == "moe":
        cfg["transformer_architecture"].update(MOE)
    for rank, history in enumerate(run_distributed(train_worker, world, cfg, timeout_seconds=600)):
        assert_parity(losses(history), eager_losses[variant], rtol=1e-5, name=f"rank {rank} compiled {sizes}")
        assert history[-1]["compile/graphs"] > 0  # it did compile


def _graphs_compiled(cfg):
    """Train from a clean Dynamo state (pooled workers keep theirs between tests); graphs compiled."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    return train_worker(cfg)[-1]["compile/graphs"]


@pytest.mark.distributed
@pytest.mark.slow
def test_identical_blocks_compile_one_graph(tiny_corpus):
    """16 blocks compile as many graphs as 2: one per distinct layer (embedding, block, head) and the loss."""
    counts = {}
    for depth in (2, 16):
        cfg = tiny_config(tiny_corpus, steps=2, training={"compile": {"enabled": True, "backend": "aot_eager"}})
        cfg["transformer_architecture"]["num_layers"] = depth
        (counts[depth],) = run_distributed(_graphs_compiled, 1, cfg, timeout_seconds=300)
    assert counts[16] == counts[2] == 4, counts


# Float8: hidden 64 and an MLP of 128 so that every block linear is a multiple of 16 at tp2
# (min_features=16 converts them all); bf16 activations, as FP8 training runs.
FP8_ARCH = {"hidden_size": 64, "intermediate_size": 128, "precision": "bf16"}
FP8_STEPS = 100


def _fp8_run(corpus, tp, fp8, compile=None, ac="none"):
    training = {"fp8": {"enabled": fp8, "min_features": 16}}
    if compile:
        training["compile"] = {"enabled": True, "backend": compile}
    cfg = tiny_config(corpus, tp=tp, steps=FP8_STEPS, training=training)
    cfg["transformer_architecture"].update(FP8_ARCH, activation_checkpointing=ac)
    cfg["topology"].update(global_batch_size=4)  # 2 micro-batches a step: the runs in CI's time
    return losses(run_distributed(train_worker, tp, cfg, timeout_seconds=600)[0])


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.skipif(float8_supported(torch.device("cpu")) is not None, reason="no float8 products on CPU here")
def test_fp8_training_tracks_bf16(tiny_corpus):
    """100 steps on the bundled corpus, FP8 (tensorwise) at tp1 compiled (aot_eager) with activation
    checkpointing and at tp2, against bf16 at tp1.

    Tolerance: every step within 5 % of the bf16 loss, and the mean of the last 50 steps within
    1 %. Why: e4m3 keeps 3 mantissa bits (a relative rounding of 2^-4 on each operand of each
    product), which perturbs every step's update a little; the perturbations average out
    rather than compound, so the curves stay together (measured over 200 steps: at most 2.5 % on
    one step, 0.07-0.19 % over the last 50; over 100: 1.9 % and 0.007-0.04 %) while a broken cast
    or scale shows at once.
    """
    bf16 = _fp8_run(tiny_corpus, 1, False)
    assert sum(bf16[-50:]) / 50 < 0.8 * bf16[0]  # it trains
    for tp, compile, ac in ((1, "aot_eager", "every_layer"), (2, None, "none")):
        fp8 = _fp8_run(tiny_corpus, tp, True, compile, ac)
        assert_parity(fp8, bf16, rtol=0.05, name=f"fp8 tp{tp} per-step losses")
        assert abs(sum(fp8[-50:]) - sum(bf16[-50:])) <= 0.01 * sum(bf16[-50:]), f"tp{tp}: last-50 mean drifts"


def _fp8_zero3_run(corpus, all_gather, compile=None):
    training = {"fp8": {"enabled": True, "min_features": 16, "all_gather": all_gather}}
    if compile:
        training["compile"] = {"enabled": True, "backend": compile}
    cfg = tiny_config(corpus, dp=2, steps=STEPS, training=training, optimizer={"zero_stage": 3})
    cfg["transformer_architecture"].update(FP8_ARCH)
    return run_distributed(train_worker, 2, cfg, timeout_seconds=300)[0]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.skipif(float8_supported(torch.device("cpu")) is not None, reason="no float8 products on CPU here")
def test_fp8_all_gather_under_zero3_trains_as_gathering_in_bf16(tiny_corpus):
    """``fp8.all_gather``: ZeRO-3 gathers the blocks' float8 weights in float8 (half the bf16 bytes;
    the byte count is checked in packages/scaling-optim/tests/test_zero3.py), and the products
    take the gathered float8 weight as it is: the bytes the products of a bf16 gather quantise
    the whole weight to, so the run equals the one gathering in bf16 bit for bit. Compiled
    (aot_eager), the linears' gathered float8 weights are graph inputs like the parameters:
    within 1e-5 per step of eager."""
    float8 = losses(_fp8_zero3_run(tiny_corpus, True))
    assert float8 == losses(_fp8_zero3_run(tiny_corpus, False))
    compiled = _fp8_zero3_run(tiny_corpus, True, "aot_eager")
    assert compiled[-1]["compile/graphs"] > 0
    assert_parity(losses(compiled), float8, rtol=1e-5, name="compiled losses")


FP8_LAYOUTS = {
    # pipeline stages, data parallel with ZeRO-1, LoRA adapters in high precision over float8 base products
    "pp2-dp2-zero1-lora": (4, {"pp": 2, "dp": 2, "optimizer": {"zero_stage": 1}}, {"finetuning": LORA}),
    "cp2-ring": (2, {"cp": 2}, {}),  # context parallelism: float8 blocks around ring attention
    "fp16": (1, {}, {"precision": "fp16"}),  # fp16 parameters with the loss scaler
}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.skipif(float8_supported(torch.device("cpu")) is not None, reason="no float8 products on CPU here")
@pytest.mark.parametrize("layout", sorted(FP8_LAYOUTS))
def test_fp8_composes_with_the_layout(tiny_corpus, layout):
    """FP8 against the same layout in high precision, 20 steps: every step within 5 % (the tolerance of
    test_fp8_training_tracks_bf16, whose reasons hold here), so float8 composes with the layout."""
    world, sizes, extra = FP8_LAYOUTS[layout]

    def run(fp8):
        cfg = tiny_config(tiny_corpus, steps=20, training={"fp8": {"enabled": fp8, "min_features": 16}}, **sizes)
        cfg["transformer_architecture"].update(FP8_ARCH)
        if "precision" in extra:
            cfg["transformer_architecture"]["precision"] = extra["precision"]
            cfg["optimizer"] = {**cfg.get("optimizer", {}), "loss_scaler": {"enable": True}}
        if "finetuning" in extra:
            cfg["finetuning"] = extra["finetuning"]
        return losses(run_distributed(train_worker, world, cfg, timeout_seconds=300)[-1])

    high, fp8 = run(False), run(True)
    assert fp8 != high  # the products really are float8
    assert_parity(fp8, high, rtol=0.05, name=f"fp8 {layout} per-step losses")


@pytest.mark.distributed
@pytest.mark.slow
def test_compiled_fp16_run_matches_eager_fp16(tiny_corpus):
    """fp16 parameters with the loss scaler, compiled (aot_eager) against eager, one rank, 10 steps:
    the same products in the same dtype, so the losses agree within 1e-5 per step."""

    def run(compile):
        cfg = tiny_config(tiny_corpus, steps=STEPS, training={"compile": {"enabled": compile, "backend": "aot_eager"}})
        cfg["transformer_architecture"]["precision"] = "fp16"
        cfg["optimizer"] = {**cfg.get("optimizer", {}), "loss_scaler": {"enable": True}}
        return run_distributed(train_worker, 1, cfg, timeout_seconds=300)[0]

    compiled, eager = run(True), run(False)
    assert compiled[-1]["compile/graphs"] > 0
    assert_parity(losses(compiled), losses(eager), rtol=1e-5, name="fp16 compiled vs eager losses")
