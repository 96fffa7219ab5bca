"""The GPU tier and the prepared GPU check behave on a machine without CUDA."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")


@pytest.mark.slow
def test_gpu_check_says_there_is_no_gpu_in_one_line_and_exits_0(tmp_path):
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check"), str(tmp_path / "report")],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        f"gpu_check: no CUDA device here (torch.cuda.is_available() is not True for {sys.executable}); nothing to check"
    ]
    assert not (tmp_path / "report").exists()


@pytest.mark.slow
def test_gpu_tier_collects_at_least_13_tests_that_skip_with_the_reason():
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/gpu", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider", "-n", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    skipped = [line for line in out.stdout.splitlines() if line.startswith("SKIPPED [")]
    assert sum(int(line.split("[")[1].split("]")[0]) for line in skipped) >= 13, out.stdout
    assert all("needs a CUDA device; none is present on this machine" in line for line in skipped), skipped
    assert " passed" not in out.stdout and " failed" not in out.stdout


def _gpu_check_bench_commands(out_dir: str) -> list[list[str]]:
    """Every ``$PY bench/....py ...`` line of scripts/gpu_check, continuation lines joined,
    ``$OUT`` and the compile step's variants (``${2:-}``: each ``compile_step KEY "ARGS"`` call's ARGS)
    filled in, as argument lists."""
    text = (ROOT / "scripts" / "gpu_check").read_text().replace("\\\n", " ")
    calls = re.findall(r'^compile_step \w+(?: "([^"]*)")?', text, re.MULTILINE)
    commands = []
    for line in text.splitlines():
        if "$PY bench/" not in line:
            continue
        words = line.split("$PY ", 1)[1].split(" 2>&1")[0].replace("$OUT", out_dir).split()
        variants = [args.split() for args in calls] if "${2:-}" in words else [[]]
        for extra in variants:
            commands.append([w for w in words if w != "${2:-}"] + extra)
    return commands


PARSE_ONLY = """
import argparse, json, os, runpy, sys
parse = argparse.ArgumentParser.parse_args

def parse_then_stop(self, *args, **kwargs):
    parse(self, *args, **kwargs)  # exits 2 naming the argument it refuses
    raise SystemExit(0)

argparse.ArgumentParser.parse_args = parse_then_stop
codes = []
for command in json.loads(sys.argv[1]):
    sys.argv = command
    here = os.path.dirname(os.path.abspath(command[0]))
    sys.path.insert(0, here)  # as `python bench/x.py` has it
    try:
        runpy.run_path(command[0], run_name="__main__")
    except SystemExit as exc:
        codes.append(exc.code or 0)
    else:
        codes.append("ran past its argument parser")
    sys.path.remove(here)
print(json.dumps(codes))
"""


@pytest.mark.slow
def test_gpu_check_bench_commands_parse(tmp_path):
    """The bench command lines gpu_check runs on a lent card (where a typo costs device time) are
    accepted by each bench's own argument parser: parsed here, not run."""
    commands = _gpu_check_bench_commands(str(tmp_path))
    assert {c[0] for c in commands} >= {
        "bench/transformer_step.py",
        "bench/offload_step.py",
        "bench/model_state_bytes.py",
        "bench/ring_block_kernels.py",
        "bench/moe_step.py",
        "bench/compile_step.py",
        "bench/float8_layers.py",
        "bench/plan_gpu_step.py",
    }
    compiles = [c for c in commands if c[0] == "bench/compile_step.py"]
    assert [" ".join(c[c.index("--profile") + 2 :]) for c in compiles] == ["", "--reference fsdp2", "--fp8 --ffn 5632"]
    # One process parses them all (torch and the benches' imports load once, not once a command).
    out = subprocess.run(
        [sys.executable, "-c", PARSE_ONLY, json.dumps(commands)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    codes = json.loads(out.stdout.splitlines()[-1])
    refused = {" ".join(command): code for command, code in zip(commands, codes, strict=True) if code != 0}
    assert not refused, f"{refused}\n{out.stderr[-2000:]}"


@pytest.mark.slow
def test_gpu_check_orders_its_steps_and_names_the_skipped_ones_for_a_second_call(tmp_path):
    """The script's own control flow, where a card would run it: its Python is told it has CUDA
    (``torch.cuda.is_available`` answers True through a sitecustomize on its path, nothing else
    changed) and the deadline is 0 s, so every step is skipped, in the documented order, and the
    last line hands them to a second call. No wheels folder and no PYTHONPATH: the script's
    path set-up must not need either."""
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "sitecustomize.py").write_text("import torch\ntorch.cuda.is_available = lambda: True\n")
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={fake}${{PYTHONPATH:+:$PYTHONPATH}} exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env |= {"PYTHON": str(python), "GPU_CHECK_DEADLINE_S": "0", "SCALING_WHEELS": str(tmp_path / "none")}
    # A bench's output left in the folder (as a first call leaves it): the summary quotes its headline.
    (tmp_path / "report").mkdir()
    (tmp_path / "report" / "bench.txt").write_text(
        "ours  130.40 ms/step\nwall ratio ours/reference = 1.025\n"
        "transformer_step: device busy 370.84 ms of 391.20 ms (94.8%); idle 20.36 ms in 41 holes; idle by range: ...\n"
    )
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check"), str(tmp_path / "report")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    order = "tests app bench plan compile compile_fsdp2 compile_fp8 fp8_layers offload checkpoint moe cp_kernels"
    assert f'run them in a second call: GPU_CHECK_STEPS="{order}"' in out.stdout, out.stdout
    assert out.stdout.count(": skipped, its limit") == 12
    assert (tmp_path / "report" / "report.txt").exists()
    summary = out.stdout.split("=== summary ===\n")[1].splitlines()
    assert summary[0] == "bench.txt:wall ratio ours/reference = 1.025", summary
    assert summary[1].startswith("bench.txt:transformer_step: device busy 370.84 ms of 391.20 ms"), summary
