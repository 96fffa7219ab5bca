"""SLURM: ``srun`` inside an allocation, else a batch script submitted and waited for; one torchrun per node.

Outside an allocation the runner starts ``python -m scaling.runner.sbatch job.sbatch``
(:mod:`scaling.runner.sbatch`: sbatch, then a one-second poll of the job, its exit code,
and ``scancel`` when the runner is stopped).

The job's output goes to ``job.out`` beside the script (unless ``slurm_config.output`` says
otherwise), which the runner follows while the job runs: its lines appear on the runner's
output as they are written, and the failure reports in them are read as from any launch.

The script holds no secret: ``sbatch`` exports the submitting environment to the job
(``--export=ALL`` is its default), so secrets reach the nodes as environment variables.
"""

from __future__ import annotations

import os
import shlex
import socket
import sys
from collections.abc import Mapping
from pathlib import Path

from scaling.runner._commands import Launch, torchrun_argv
from scaling.runner._config import RunnerConfig

# Placeholders survive shlex quoting unchanged and are then replaced by shell expansions.
_MASTER = "SCALING_MASTER_PLACEHOLDER"
_JOB = "SCALING_JOB_PLACEHOLDER"


def slurm_dir(config: RunnerConfig, run_id: str) -> Path:
    """Where the payload file and the sbatch script of a SLURM run are written."""
    return Path(config.payload_dir or ".scaling-run").absolute() / run_id


def build_slurm_launch(
    config: RunnerConfig, run_id: str, payload_env: Mapping[str, str], environ: Mapping[str, str], port: int
) -> Launch:
    """``srun`` when ``SLURM_JOB_ID`` is set (inside an allocation), else the batch script and its waiter."""
    sc = config.slurm_config
    python = config.python_executable or sys.executable
    srun = ["srun", "--nodes", str(sc.num_nodes), "--ntasks-per-node", "1", "--kill-on-bad-exit=1"]
    if "SLURM_JOB_ID" in environ:
        master = config.master_addr or socket.gethostname()
        rdzv_id = config.run_id or f"slurm-{environ['SLURM_JOB_ID']}"
        inner = torchrun_argv(python, config, sc.num_nodes, config.nproc_per_node, f"{master}:{port}", rdzv_id)
        label = f"srun in allocation {environ['SLURM_JOB_ID']}: {sc.num_nodes} node(s) x {config.nproc_per_node}"
        return Launch(label, tuple(srun + inner), {**config.env, **payload_env})
    master = config.master_addr or _MASTER
    inner = torchrun_argv(python, config, sc.num_nodes, config.nproc_per_node, f"{master}:{port}", _JOB)
    srun_line = shlex.join(srun + inner)
    srun_line = srun_line.replace(_MASTER, '"$MASTER_ADDR"').replace(_JOB, '"scaling-$SLURM_JOB_ID"')
    job_output = str(slurm_dir(config, run_id) / "job.out")
    lines = ["#!/bin/bash", f"#SBATCH --job-name={sc.job_name}", f"#SBATCH --nodes={sc.num_nodes}"]
    lines.append("#SBATCH --ntasks-per-node=1")
    for flag, value in (
        ("partition", sc.partition),
        ("account", sc.account),
        ("time", sc.time_limit),
        ("gpus-per-node", sc.gpus_per_node),
        ("output", sc.output or job_output),
    ):
        if value is not None:
            lines.append(f"#SBATCH --{flag}={value}")
    lines += [f"#SBATCH {arg}" for arg in sc.extra_args]
    lines += ["set -euo pipefail", f"cd {shlex.quote(config.workdir or os.getcwd())}"]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in {**config.env, **payload_env}.items()]
    if config.master_addr is None:
        # The first node's address as SLURM knows it (NodeAddr; the node name where none is set).
        lines.append('FIRST_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)')
        lines.append("MASTER_ADDR=$(scontrol show node \"$FIRST_NODE\" | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p')")
    lines.append(srun_line)
    script_path = slurm_dir(config, run_id) / "job.sbatch"
    label = f"sbatch: {sc.num_nodes} node(s) x {config.nproc_per_node} processes"
    return Launch(
        label,
        (sys.executable, "-m", "scaling.runner.sbatch", str(script_path)),
        {},
        files=((str(script_path), "\n".join(lines) + "\n"),),
        follow=None if sc.output else job_output,
    )
