"""The command line and the config: bad input is refused before launch with the field, value and fix."""

import math
import shlex
from pathlib import Path

import pytest
import yaml
from transformer_testlib import TINY_VOCAB, losses, tiny_config, train_worker

from scaling.testing import run_distributed
from scaling.transformer.__main__ import DEFAULT_CONFIG, main
from scaling.transformer.config import TransformerConfig


def _train(capsys, corpus, tmp_path, *overrides, arch=None):
    cfg = tiny_config(corpus)
    cfg["transformer_architecture"].update(arch or {})
    path = tmp_path / "c.yml"
    path.write_text(yaml.safe_dump(cfg))
    code = main(["train", str(path), *overrides])
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["transformer_architecture.num_kv_heads=3"], "num_attention_heads=4 is not divisible by num_kv_heads=3"),
        (["transformer_architecture.num_attention_heads=5"], "num_attention_heads=5 does not divide hidden_size=32"),
        (
            ["topology.model_parallel_size=4", "runner.nproc_per_node=4"],
            r"model_parallel_size=4 cannot shard num_attention_heads=4 with num_kv_heads=2; choose .* \[1, 2\]",
        ),
        (
            ["data.sequence_length=128"],
            "data.sequence_length=128 exceeds transformer_architecture.max_sequence_length=64",
        ),
        (["transformer_architecture.precision=fp16"], "precision='fp16' needs optimizer.loss_scaler.enable=true"),
        (["runner.nproc_per_node=2"], "runner.nproc_per_node=2 start 2 processes, but topology.world_size=1"),
        (["transformer_architecture.vocab_size=200"], f"holds token id {TINY_VOCAB - 1} but transformer_architecture"),
        (["transformer_architecture.mlp_type=relu"], "mlp_type"),
        (["training.num_virtual_stages=2"], "num_virtual_stages=2 needs training.schedule='interleaved_1f1b'"),
        (
            ["training.schedule=zb_v", "training.num_virtual_stages=3"],
            "num_virtual_stages=3: schedule='zb_v' runs exactly 2 chunks per stage",
        ),
        (
            [
                "training.schedule=zb_v",
                "topology.pipe_parallel_size=2",
                "runner.nproc_per_node=2",
                "transformer_architecture.num_layers=4",
            ],
            r"num_layers=4 \+ embedding \+ head = 6 pipeline layers do not split into topology.pipe_parallel_size=2 "
            r"x 2 chunks per stage .*choose num_layers \+ 2 a multiple of 4",
        ),  # fmt: skip
        (
            ["topology.context_parallel_size=3", "runner.nproc_per_node=3"],
            r"data.sequence_length=16 is not divisible by 2 × topology.context_parallel_size = 6 .*choose a multiple of 6",
        ),
        (
            [
                "topology.context_parallel_size=4",
                "runner.nproc_per_node=8",
                "topology.model_parallel_size=2",
                "transformer_architecture.context_parallel_method=all_to_all",
            ],
            r"needs the 2 query heads of each tensor-parallel rank to divide by context_parallel_size=4; use "
            r"context_parallel_method='ring'",
        ),
        (
            [
                "topology.context_parallel_size=2",
                "runner.nproc_per_node=2",
                "transformer_architecture.attention_dropout=0.1",
            ],
            r"attention_dropout=0.1 with context_parallel_size=2: .*set attention_dropout=0",
        ),
        (
            [
                "topology.context_parallel_size=4",
                "runner.nproc_per_node=16",
                "topology.model_parallel_size=4",
                "transformer_architecture.num_kv_heads=4",
                "transformer_architecture.sequence_parallel=true",
                "data.sequence_length=24",
            ],
            r"data.sequence_length=24 / topology.context_parallel_size=4 = 6 tokens per CP rank is not divisible by "
            r"topology.model_parallel_size=4",
        ),
        (
            ["topology.data_parallel_size=2", "topology.expert_parallel_size=2", "runner.nproc_per_node=2"],
            r"topology.expert_parallel_size=2 needs mixture-of-experts blocks: set transformer_architecture.moe",
        ),
        (
            [
                "topology.data_parallel_size=4",
                "topology.expert_parallel_size=4",
                "runner.nproc_per_node=4",
                "transformer_architecture.moe.num_experts=6",
            ],
            r"num_experts=6 is not divisible by expert_parallel_size=4; choose expert_parallel_size in \[1, 2, 3, 6\]",
        ),
        (["transformer_architecture.moe.top_k=9"], r"top_k=9 must be between 1 and num_experts=8"),
        (
            ["transformer_architecture.moe.every=3"],  # 2 blocks: (i + 1) % 3 == 0 for neither
            r"transformer_architecture.moe.every=3 with first_dense_layers=0 leaves none of the num_layers=2 blocks a "
            "mixture of experts",
        ),
        (
            [
                "transformer_architecture.latent_attention={kv_lora_rank: 8}",
                "transformer_architecture.num_kv_heads=null",
                "transformer_architecture.qk_norm=true",
            ],
            r"transformer_architecture.latent_attention is set with qk_norm=True, which latent attention does not "
            r"have; use qk_norm=False or latent_attention: null",
        ),
        (
            [
                "transformer_architecture.latent_attention={kv_lora_rank: 8}",
                "transformer_architecture.num_kv_heads=null",
                "topology.context_parallel_size=2",
                "runner.nproc_per_node=2",
            ],
            r"topology.context_parallel_size=2 with transformer_architecture.latent_attention: latent attention has "
            r"no context-parallel form yet",
        ),
        (
            ["transformer_architecture.moe.num_groups=3"],
            r"num_groups=3 must divide num_experts=8 into groups of at least 2 experts .* \[1, 2, 4\]",
        ),
        (
            [
                "topology.model_parallel_size=2",
                "runner.nproc_per_node=2",
                "transformer_architecture.hidden_size=128",
                "transformer_architecture.intermediate_size=200",
                "training.fp8.enabled=true",
                "training.fp8.min_features=16",
            ],
            r"fp8: layer 'block.mlp.gate_proj' has local weight shape \[100, 128\]; float8 products need sizes "
            r"that are multiples of 16. Keep it in high precision: add the regex mlp\\.gate_proj to training.fp8.exclude",
        ),
        (
            ["data.sequence_length=12", "training.fp8.enabled=true", "training.fp8.min_features=16"],
            r"training.fp8.enabled=true: 24 tokens per micro-batch and rank \(topology.micro_batch_size=2 x "
            r"data.sequence_length=12 / topology.context_parallel_size=1\); float8 products need a multiple of 16",
        ),
        (
            ["transformer_architecture.vocab_size=1000000000000"],
            r"vocab_size\n  Input should be less than or equal to 4294967296",
        ),
        (
            ["transformer_architecture.hidden_size=131072", "transformer_architecture.num_layers=10000"],
            r"transformer_architecture has 1.89e\+15 parameters \(vocab_size=300, hidden_size=131072, num_layers=10000\): "
            r"6.88e\+03 TiB of fp32 weights per rank even spread over all 1 ranks, beyond the 4 TiB",
        ),
        (
            [
                "topology.model_parallel_size=2",
                "runner.nproc_per_node=2",
                "training.compile.enabled=true",
                "training.compile.fullgraph=true",
            ],
            r"training.compile.fullgraph=true with topology.model_parallel_size=2: the layers' collectives break "
            r"the graph, which fullgraph refuses at the first step; set training.compile.fullgraph=false",
        ),
    ],
    ids=[
        "kv-heads",
        "heads-hidden",
        "tp-heads",
        "seq-len",
        "fp16",
        "nproc",
        "data-vocab",
        "mlp-type",
        "virtual",
        "zb-v-chunks",
        "zb-v-layers",
        "cp-seq-len",
        "cp-a2a-heads",
        "cp-dropout",
        "cp-sp-seq-len",
        "ep-without-moe",
        "ep-experts",
        "moe-top-k",
        "moe-no-block",
        "latent-qk-norm",
        "latent-cp",
        "moe-groups",
        "fp8-shape",
        "fp8-tokens",
        "vocab-beyond-uint32",
        "beyond-any-machine",
        "fullgraph-tp",
    ],
)
def test_bad_config_is_refused(capsys, tiny_corpus, tmp_path, overrides, match):
    code, err = _train(capsys, tiny_corpus, tmp_path, *overrides)
    assert code == 2
    assert __import__("re").search(match, err), err


def test_missing_default_corpus(capsys, tmp_path):
    code = main(["train", str(DEFAULT_CONFIG), f"data.default_corpus_dir={tmp_path / 'none'}"])
    assert code == 2 and "run `scaling-transformer preprocess` first" in capsys.readouterr().err


def test_template_lists_every_section(capsys):
    assert main(["train", "--template"]) == 0
    assert set(yaml.safe_load(capsys.readouterr().out)) == set(TransformerConfig.model_fields)


def test_the_readmes_gpu_command_is_a_valid_config():
    """The README's "On GPUs" command (its config and overrides) validates as it is written."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = readme.split("## On GPUs", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    words = shlex.split(block.replace("\\\n", " "))
    assert words[:2] == ["scaling-transformer", "train"]
    root = Path(__file__).resolve().parents[3]
    cfg = TransformerConfig.from_file(root / words[2], overrides=words[3:])
    assert (cfg.topology.device, cfg.topology.world_size, cfg.runner.nproc_per_node) == ("cuda", 8, 8)
    assert cfg.training.compile.enabled and cfg.profiler.memory_snapshot


def test_default_config_is_valid():
    cfg = TransformerConfig.from_yaml(DEFAULT_CONFIG)
    assert cfg.topology.world_size == 1 and cfg.runner.script.endswith("scaling/transformer/train.py")


@pytest.mark.distributed
def test_loss_falls_on_the_embedded_corpus(tiny_corpus):
    """The default recipe on a small budget: 30 steps take the validation loss well below uniform."""
    cfg = tiny_config(tiny_corpus, steps=30, trainer={"eval_interval": 10, "eval_iterations": 2})
    (history,) = run_distributed(train_worker, 1, cfg, timeout_seconds=180)
    evals = losses(history, "evaluation/loss")
    assert len(evals) == 3 and evals[0] > evals[1] > evals[2]
    assert evals[-1] < 0.85 * math.log(TINY_VOCAB), evals  # 4.85; uniform is 5.70
    assert all(m["runtime/tokens_per_second"] > 0 for m in history if "training/loss" in m)
    # TFLOP/s per device from the BaseTrainer, given the app's FLOPs per sample.
    assert all(m["runtime/tflops_per_device"] > 0 for m in history if "training/loss" in m)
