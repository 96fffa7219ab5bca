import subprocess
import sys
import textwrap

import pytest
from pydantic import ValidationError

from scaling.topology import TopologyConfig


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ({"world_size": 8, "model_parallel_size": 2, "pipe_parallel_size": 2}, (8, 2, 2, 2)),
        ({"model_parallel_size": 2, "pipe_parallel_size": 2, "data_parallel_size": 2}, (8, 2, 2, 2)),
        ({"world_size": 8, "model_parallel_size": 2, "data_parallel_size": 2}, (8, 2, 2, 2)),
        ({"world_size": 8, "pipe_parallel_size": 4, "data_parallel_size": 1}, (8, 2, 4, 1)),
        ({"world_size": 4}, (4, 1, 1, 4)),
        ({"data_parallel_size": 3}, (3, 1, 1, 3)),
        ({}, (1, 1, 1, 1)),  # a default written into a config class: one process
        ({"model_parallel_size": 2}, (2, 2, 1, 1)),
        ({"world_size": 6, "model_parallel_size": 2, "pipe_parallel_size": 3, "data_parallel_size": 1}, (6, 2, 3, 1)),
        # Context parallelism multiplies the ranks: world = tp × cp × pp × dp.
        ({"world_size": 8, "context_parallel_size": 2, "model_parallel_size": 2}, (8, 2, 1, 2)),
        ({"context_parallel_size": 4, "data_parallel_size": 2}, (8, 1, 1, 2)),
        ({"context_parallel_size": 2}, (2, 1, 1, 1)),
    ],
)
def test_sizes_derived(given, expected):
    c = TopologyConfig(**given)
    assert (c.world_size, c.model_parallel_size, c.pipe_parallel_size, c.data_parallel_size) == expected


def test_context_parallelism_does_not_change_the_batch():
    c = TopologyConfig(world_size=8, context_parallel_size=4, micro_batch_size=2, gradient_accumulation_steps=3)
    assert (c.data_parallel_size, c.global_batch_size) == (2, 12)


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ({"micro_batch_size": 2, "gradient_accumulation_steps": 3}, (12, 2, 3)),
        ({"global_batch_size": 12, "micro_batch_size": 2}, (12, 2, 3)),
        ({"global_batch_size": 12, "gradient_accumulation_steps": 3}, (12, 2, 3)),
        ({"micro_batch_size": 5}, (10, 5, 1)),
        ({"global_batch_size": 12, "micro_batch_size": 3, "gradient_accumulation_steps": 2}, (12, 3, 2)),
    ],
)
def test_batches_derived(given, expected):
    c = TopologyConfig(world_size=2, **given)
    assert (c.global_batch_size, c.micro_batch_size, c.gradient_accumulation_steps) == expected


INVALID = [
    (
        {"world_size": 8, "model_parallel_size": 2, "pipe_parallel_size": 2, "data_parallel_size": 3},
        r"world_size=8 does not equal model_parallel_size=2 × pipe_parallel_size=2 × data_parallel_size=3 = 12",
    ),
    (
        {"world_size": 6, "model_parallel_size": 4, "pipe_parallel_size": 1},
        r"world_size=6 is not divisible by model_parallel_size=4 × pipe_parallel_size=1 = 4",
    ),
    (
        {"world_size": 0},
        r"world_size\n  Input should be greater than or equal to 1 \[type=greater_than_equal, input_value=0",
    ),
    (
        {"world_size": 2, "micro_batch_size": -1},
        r"micro_batch_size\n  Input should be greater than or equal to 1.*input_value=-1",
    ),
    (
        {"world_size": 2, "global_batch_size": 10, "micro_batch_size": 3, "gradient_accumulation_steps": 2},
        r"global_batch_size=10 does not equal micro_batch_size=3 × gradient_accumulation_steps=2 × data_parallel_size=2 = 12",
    ),
    (
        {"world_size": 2, "global_batch_size": 9, "micro_batch_size": 2},
        r"global_batch_size=9 is not divisible by micro_batch_size=2 × data_parallel_size=2 = 4",
    ),
    ({"world_size": 2, "gradient_accumulation_steps": 4, "global_batch_size": None}, r"give two of global_batch_size"),
    ({"world_size": 2, "bogus": 1}, r"bogus\n  Extra inputs are not permitted"),
    ({"world_size": "two"}, r"world_size\n  Input should be a valid integer.*input_value='two'"),
    ({"world_size": 2, "device": "tpu"}, r"device\n  Input should be 'auto', 'cpu' or 'cuda'.*input_value='tpu'"),
    ({"world_size": 2, "device": "cpu", "backend": "nccl"}, r"backend='nccl' needs device='cuda'"),
    ({"world_size": 2, "timeout_seconds": 0}, r"timeout_seconds\n  Input should be greater than 0"),
    (
        {"world_size": 6, "context_parallel_size": 4},
        r"world_size=6 is not divisible by model_parallel_size=1 × pipe_parallel_size=1 × context_parallel_size=4 = 4",
    ),
    (
        {
            "world_size": 8,
            "model_parallel_size": 2,
            "pipe_parallel_size": 1,
            "data_parallel_size": 2,
            "context_parallel_size": 3,
        },
        r"world_size=8 does not equal model_parallel_size=2 × context_parallel_size=3 × pipe_parallel_size=1 × "
        r"data_parallel_size=2 = 12",
    ),
    (
        {"world_size": 2, "context_parallel_size": 0},
        r"context_parallel_size\n  Input should be greater than or equal to 1",
    ),
]


@pytest.mark.parametrize(("given", "message"), INVALID)
def test_invalid_configs_name_field_and_values(given, message):
    with pytest.raises(ValidationError, match=message):
        TopologyConfig(**given)


@pytest.mark.slow
def test_invalid_configs_under_python_O():
    """Validation must not rely on assert: the same errors appear under python -O."""
    script = textwrap.dedent(
        f"""
        import re
        from scaling.topology import TopologyConfig
        cases = {INVALID!r}
        for given, message in cases:
            try:
                TopologyConfig(**given)
            except ValueError as e:
                assert_ok = re.search(message, str(e)) is not None
                if not assert_ok:
                    raise SystemExit(f"wrong message for {{given}}: {{e}}")
            else:
                raise SystemExit(f"accepted under -O: {{given}}")
        print("all rejected")
        """
    )
    out = subprocess.run([sys.executable, "-O", "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "all rejected" in out.stdout


def test_frozen():
    c = TopologyConfig(world_size=2)
    with pytest.raises(ValidationError, match="frozen"):
        c.world_size = 4  # type: ignore[misc]


def test_gloo_with_cuda_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"backend='gloo' carries CPU tensors; with device='cuda' use backend='nccl'"):
        TopologyConfig(world_size=1, device="cuda", backend="gloo")
