"""Bad input is refused before anything launches, with the field, the value and the fix."""

import pytest
import yaml
from mlp_testlib import small_config, train_worker, write_mnist

from scaling.mlp.__main__ import DEFAULT_CONFIG, main
from scaling.mlp.config import MLPConfig
from scaling.testing import run_distributed


def _run(capsys, *args):
    code = main([str(DEFAULT_CONFIG), *args])
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["runner.nproc_per_node=4"],
            "runner.nproc_per_node=4 start 4 processes, but topology.world_size=8; set runner.nproc_per_node=8",
        ),
        (
            ["runner.runner_type=slurm", "runner.slurm_config.num_nodes=2", "runner.nproc_per_node=2"],
            "runner.slurm_config.num_nodes=2 × runner.nproc_per_node=2 start 4 processes, but topology.world_size=8; "
            "set num_nodes × nproc_per_node = 8",
        ),
        (
            ["runner.runner_type=pdsh", "runner.hosts=[a slots=4,b slots=2]"],
            "the hosts' slots (a=4, b=2) start 6 processes, but topology.world_size=8; set hosts whose slots add up to 8",
        ),
    ],
    ids=["local", "slurm", "pdsh"],
)
def test_layout_not_matching_process_count(capsys, args, expected):
    code, err = _run(capsys, *args)
    assert code == 2
    assert expected in err


def test_topology_arithmetic_named(capsys):
    code, err = _run(capsys, "topology.world_size=6")
    assert (
        code == 2
        and "world_size=6 does not equal model_parallel_size=2 × pipe_parallel_size=2 × data_parallel_size=2" in err
    )


def test_hidden_size_not_divisible_by_tp(capsys):
    code, err = _run(capsys, "architecture.hidden_size=255")
    assert code == 2 and "architecture.hidden_size=255 is not divisible by topology.model_parallel_size=2" in err


def test_missing_mnist_path(capsys, tmp_path):
    code, err = _run(capsys, f"data.mnist_path={tmp_path / 'missing'}")
    assert code == 2 and "is not a directory; set it to the folder holding MNIST's IDX files" in err


def test_corrupt_idx_file(capsys, tmp_path):
    write_mnist(tmp_path)
    labels = tmp_path / "t10k-labels-idx1-ubyte"
    labels.write_bytes(labels.read_bytes()[:-1])
    code, err = _run(capsys, f"data.mnist_path={tmp_path}")
    assert code == 2 and "t10k-labels-idx1-ubyte: header says shape [6]" in err


def test_unknown_key(capsys):
    code, err = _run(capsys, "trainer.train_iters=5")
    assert code == 2 and "trainer.train_iters\n  Extra inputs are not permitted" in err


def test_template_lists_every_section(capsys):
    assert main(["--template"]) == 0
    template = yaml.safe_load(capsys.readouterr().out)
    assert set(template) == set(MLPConfig.model_fields)


def test_default_config_is_3d_parallel():
    cfg = MLPConfig.from_yaml(DEFAULT_CONFIG)
    t = cfg.topology
    assert (t.data_parallel_size, t.pipe_parallel_size, t.model_parallel_size) == (2, 2, 2)
    assert cfg.runner.nproc_per_node == 8 and cfg.runner.script.endswith("scaling/mlp/train.py")


@pytest.mark.parametrize(
    "bad", ["topology.pipe_parallel_size=8 topology.data_parallel_size=1 runner.nproc_per_node=16"]
)
def test_more_stages_than_layers(capsys, bad):
    code, err = _run(capsys, *bad.split())
    assert code == 2 and "topology.pipe_parallel_size=8 exceeds the model's 4 layers" in err


@pytest.mark.slow
def test_a_tampered_checkpoint_is_named_in_the_runners_summary(tmp_path, capfd):
    cfg = small_config(steps=2)
    cfg["trainer"].update(save_dir=str(tmp_path / "ckpt"), save_interval=2)
    (tmp_path / "c.yml").write_text(yaml.safe_dump(cfg))
    run_distributed(train_worker, 1, cfg)  # the checkpoint, on a pooled rank (no launch)
    shard = next((tmp_path / "ckpt").glob("step_*/*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    capfd.readouterr()
    assert main([str(tmp_path / "c.yml"), f"trainer.load_dir={tmp_path / 'ckpt'}", "trainer.train_iterations=4"]) == 1
    summary = [
        line for line in capfd.readouterr().err.splitlines() if line.startswith("scaling-run: first failure: rank 0")
    ]
    assert len(summary) == 1, summary
    assert "exited with code 1: " in summary[0] and "CheckpointError: checkpoint " in summary[0]
    assert f"{shard}: sha256 differs from commit.json" in summary[0]


@pytest.mark.parametrize("module", ["scaling.mlp.__main__", "scaling.transformer.__main__"])
def test_the_apps_say_their_first_line_before_importing_torch(module):
    # The first line ("checking <config>") is printed right after the arguments are parsed: what the
    # command line module imports by then must not include torch (seconds to import).
    import subprocess
    import sys

    code = f"import sys, {module}; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


def test_an_override_in_the_place_of_the_config_is_an_override(capsys):
    assert main(["topology.world_size=6"]) == 2  # the bundled config with this override
    captured = capsys.readouterr()
    assert captured.out.startswith(f"scaling.mlp: checking {DEFAULT_CONFIG} with topology.world_size=6\n")
    assert "world_size=6 does not equal" in captured.err
