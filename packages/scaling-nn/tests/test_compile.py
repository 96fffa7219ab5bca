"""Regional compilation: a compiled layer equals the eager one, identical layers share one graph,
hooks stay outside the compiled region, and recompilations are reported with Dynamo's reason."""

import copy

import pytest
import torch
import torch.nn.functional as F

from scaling.nn import (
    CompileConfig,
    CompileMonitor,
    ParallelSwiGLUMLP,
    compile_layer,
    compile_layers,
    compile_loss,
    vocab_parallel_cross_entropy,
)
from scaling.testing import assert_parity


class Block(torch.nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.mlp = ParallelSwiGLUMLP(width, 2 * width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


def _run(blocks, x):
    for block in blocks:
        x = block(x)
    x.square().mean().backward()
    return x


def test_disabled_leaves_the_layer_eager():
    block = Block()
    compile_layer(block, CompileConfig())
    assert "forward" not in vars(block)


def test_compiled_layers_equal_eager_and_share_one_graph():
    torch.manual_seed(0)
    eager = [Block() for _ in range(6)]
    compiled = copy.deepcopy(eager)
    torch._dynamo.reset()
    monitor = CompileMonitor()
    compile_layers(compiled, CompileConfig(enabled=True, backend="aot_eager"))
    x = torch.randn(2, 5, 8, requires_grad=True)  # every block's input requires grad: one guard set
    expected, out = _run(eager, x), _run(compiled, x)
    graphs, reasons = monitor.poll()
    assert graphs == 1 and reasons == []  # six identical blocks, one graph
    assert_parity(out, expected, rtol=1e-6, atol=1e-7, name="output")
    for (name, a), b in zip(
        [(n, p) for m in compiled for n, p in m.named_parameters()], [p for m in eager for p in m.parameters()]
    ):
        assert_parity(a.grad, b.grad, rtol=1e-6, atol=1e-7, name=name)


def test_hooks_stay_outside_the_compiled_region():
    """ZeRO-3 frees storage in forward hooks; the compiled forward must not trace them."""
    block = Block()
    calls = []
    block.register_forward_pre_hook(lambda module, args: calls.append("pre"))
    block.register_forward_hook(lambda module, args, out: calls.append("post"))
    compile_layer(block, CompileConfig(enabled=True, backend="eager"))
    for _ in range(2):
        block(torch.randn(2, 3, 8))
    assert calls == ["pre", "post", "pre", "post"]


def test_recompilation_is_reported_with_its_reason():
    block = Block()
    compile_layer(block, CompileConfig(enabled=True, backend="eager"))
    torch._dynamo.reset()
    monitor = CompileMonitor()
    block(torch.randn(2, 3, 8))
    assert monitor.poll() == (1, [])
    block(torch.randn(2, 3, 8))
    assert monitor.poll() == (0, [])  # warm: nothing new
    block(torch.randn(4, 3, 8))  # another batch size
    graphs, reasons = monitor.poll()
    assert graphs == 1 and len(reasons) == 1
    assert reasons[0].startswith("Block.forward: ") and "size mismatch" in reasons[0], reasons


def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return vocab_parallel_cross_entropy(logits, targets, None)


def test_the_loss_compiles_with_the_layers_unless_told_not_to():
    assert compile_loss(_cross_entropy, None) is _cross_entropy
    assert compile_loss(_cross_entropy, CompileConfig()) is _cross_entropy  # compile off
    assert compile_loss(_cross_entropy, CompileConfig(enabled=True, loss=False)) is _cross_entropy
    torch.manual_seed(0)
    logits = torch.randn(2, 7, 50, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 50, (2, 7))
    targets[0, 0] = -100  # ignored
    expected = _cross_entropy(logits, targets)
    (expected_grad,) = torch.autograd.grad(expected, logits)
    torch._dynamo.reset()
    monitor = CompileMonitor()
    compiled = compile_loss(_cross_entropy, CompileConfig(enabled=True, backend="aot_eager"))
    loss = compiled(logits, targets)
    (grad,) = torch.autograd.grad(loss, logits)
    assert monitor.poll() == (1, [])  # one graph: the loss, forward and backward
    assert_parity(loss, expected, rtol=1e-6, atol=1e-7, name="loss")
    assert_parity(grad, expected_grad, rtol=0, atol=0, name="logits' gradient")


def test_each_cpu_capability_gets_its_own_inductor_cache(monkeypatch, tmp_path):
    # Kernels an avx2 run left in inductor's cache crashed a later avx512 run on the same machine.
    import getpass
    import os
    import tempfile

    from scaling.nn import _compile

    default = os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
    mine = tmp_path / "mine"
    for capability, before, cache_dir, after in [
        ("avx2", None, None, f"{default}_avx2"),
        ("default", default, None, f"{default}_default"),  # torch's own default, written on first use: not chosen
        # The same call again after the variable went back to torch's default (a test worker's
        # environment restored between tasks): checked every time, not once per process.
        ("default", default, None, f"{default}_default"),
        ("avx512", f"{default}_avx2", None, f"{default}_avx512"),  # another capability in the same process
        ("avx2", "/data/mine", None, "/data/mine"),  # chosen by the user: kept
        (None, None, None, None),  # without the variable nothing changes
        ("avx2", default, mine, str(mine.resolve() / "avx2")),  # CompileConfig.cache_dir: its own subfolder
        (None, default, mine, str(mine.resolve())),
    ]:
        for name, value in (("ATEN_CPU_CAPABILITY", capability), ("TORCHINDUCTOR_CACHE_DIR", before)):
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        _compile._use_cache_dir(cache_dir)
        assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") == after, (capability, before, cache_dir)


RESTART = """
import json, sys, pathlib
import pytest
import torch
from torch._dynamo.utils import counters
from scaling.nn import CompileConfig, compile_layer

model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 16))
for layer in model:
    compile_layer(layer, CompileConfig(enabled=True, cache_dir=pathlib.Path(sys.argv[1])))
model(torch.randn(4, 16)).sum().backward()
print(json.dumps({**counters["aot_autograd"], **counters["inductor"]}))
"""


@pytest.mark.slow
def test_compile_cache_dir_is_reused_by_a_restart(tmp_path):
    """CompileConfig.cache_dir: a second process (a restart, or another rank) loads every graph
    from the folder the first one filled, compiling none (issue 55)."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    runs = []
    for _ in range(2):
        out = subprocess.run(
            [sys.executable, "-c", RESTART, str(tmp_path / "cache")],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        runs.append(json.loads(out.stdout.splitlines()[-1]))
    first, second = runs
    graphs = first["autograd_cache_miss"]  # Linear, GELU, Linear: forward and backward each
    assert graphs == 3 and first.get("autograd_cache_hit", 0) == 0, first
    assert second.get("autograd_cache_hit") == graphs and second.get("autograd_cache_miss", 0) == 0, second
    assert second.get("fxgraph_cache_miss", 0) == 0, second
    assert any((tmp_path / "cache").rglob("*")), "nothing written to cache_dir"


def loss_over_two_groups_worker() -> list[tuple[float, float]]:
    """One compiled loss called with a group of one rank and then, on logits of the same shape, with
    one of two ranks, as a process that builds a second trainer would: each call must take its own
    group's path (the suite's pooled workers once ran a TP=2 loss down the TP=1 graph an earlier
    test had compiled: "Target 271 is out of bounds")."""
    import torch.distributed as dist

    from scaling.nn import vocab_range

    one, two = dist.new_group([0]), dist.new_group([0, 1])
    torch.manual_seed(0)
    logits, targets = torch.randn(6, 10), torch.randint(0, 10, (6,))
    loss = compile_loss(vocab_parallel_cross_entropy, CompileConfig(enabled=True, backend="eager"))
    pairs = []
    if dist.get_rank() == 0:  # 5 classes whole on one rank
        small = targets % 5
        pairs.append((loss(logits[:, :5], small, one).item(), F.cross_entropy(logits[:, :5], small).item()))
    start, end = vocab_range(10, 2, dist.get_rank())  # 10 classes, 5 a rank
    pairs.append((loss(logits[:, start:end], targets, two).item(), F.cross_entropy(logits, targets).item()))
    return pairs


@pytest.mark.distributed
def test_a_compiled_loss_follows_the_group_it_is_given_not_the_first_one():
    from scaling.testing import run_distributed

    for rank, pairs in enumerate(run_distributed(loss_over_two_groups_worker, 2)):
        for got, expected in pairs:
            assert got == pytest.approx(expected, rel=1e-6), f"rank {rank}: {pairs}"
