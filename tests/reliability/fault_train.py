"""Training script the reliability tests launch through the runner (torchrun), with faults on demand.

A tiny classifier with dropout (column- then row-parallel linear) trained by ``BaseTrainer``
on four Gaussian blobs. The payload is ``{"config": {...}, "out_dir": str, "faults": [...]}``;
``config`` holds the ``trainer``, ``topology``, ``logger`` and ``optimizer`` sections. Each fault
is a dict with ``kind``, ``rank`` and ``step`` (the optimizer step being run, 1-based):

- ``signal``: the rank sends itself ``signum`` in the middle of the step (inside the loss);
- ``sleep``: the rank sleeps ``seconds`` in the middle of the step, before its next collective;
- ``exit``: the rank exits with ``code`` at the start of the step; with a ``step`` past
  ``train_iterations``, after training finished on every rank (its peers exit 0);
- ``nan_loss``: the rank's loss of that step is NaN;
- ``inf_grad``: one element of the gradient of the rank's first-layer weight is +Inf;
- ``kill_in_save``: the rank SIGKILLs itself while committing the checkpoint of ``step``,
  after its shards are on disk and before the commit marker exists;
- ``kill_in_memory_load``: the rank SIGKILLs itself when it starts reading its in-memory
  checkpoint after a restart (give it ``attempt: 1``);
- ``sigkill``: the rank SIGKILLs itself in the middle of the step, first moving ``trainer.save_dir``
  aside (to ``<save_dir>.hidden``) when ``hide_save_dir`` is set: a restart can then resume
  only from what is held in memory.

A fault fires in the launcher's attempt ``attempt`` only (default 0: not again after torchrun
restarted the workers, who run the step again).

Every rank writes ``out_dir/rank<R>.json`` at the start (pid, and a sha256 of each
environment variable listed in ``echo_env_hash``: proof the worker can read a secret
without it appearing anywhere) and ``out_dir/steps_rank<R>.jsonl`` (one line per finished
step: loss, whether the optimizer skipped it, a hash of parameters and optimizer state, the
launcher's attempt and the time).
A rank whose trainer (loading included) raises writes the exception to
``out_dir/error_rank<R>.txt`` first. A payload ``step_delay_s`` makes every step sleep that
long (losses unchanged): a short run then lasts long enough to be signalled mid-run.
"""

from __future__ import annotations

# ruff: noqa: E402 (the imports follow gc.disable())
# Start-up and exit cost most of this short-lived rank's CPU, and the suite launches it dozens
# of times: no cyclic garbage collection while torch imports, what the imports made frozen out
# of the collector's sight (else the first passes after gc.enable() walk it all: ~0.3 s a
# process), and no interpreter teardown after a clean run (below; ~0.7 s: torch unregisters
# every operator it registered from Python). None of it changes what the tests check.
import gc

gc.disable()

import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from scaling.config import BaseConfig
from scaling.nn import LayerSpec
from scaling.optim import Optimizer, OptimizerConfig, OptimizerParamGroup, OptimizerParamGroupConfig
from scaling.pipeline import ParallelModule
from scaling.runner import load_payload
from scaling.topology import Topology, TopologyConfig
from scaling.trainer import BaseContext, BaseTrainer, TrainerConfig
from scaling.trainer.loggers import LoggerConfig

# The classifier and its data are the trainer tests' own (one definition for both suites).
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "packages" / "scaling-trainer" / "tests"))
from trainer_model import IO, Batch, Blobs, Head, Hidden

gc.freeze()
gc.enable()


class ReliabilityConfig(BaseConfig):
    _require_descriptions = False
    trainer: TrainerConfig
    topology: TopologyConfig
    logger: LoggerConfig = LoggerConfig()
    optimizer: OptimizerConfig = OptimizerConfig()


def state_hash(module: ParallelModule, optimizer: Optimizer) -> str:
    """sha256 of this rank's parameters and optimizer state (local shards, exact bytes)."""
    h = hashlib.sha256()
    for name, p, _ in module.named_parameters_with_meta():
        h.update(name.encode())
        h.update(p.detach().numpy().tobytes())
    for slot in optimizer.slots:
        for key in sorted(slot.state):
            value = slot.state[key]
            if isinstance(value, torch.Tensor):
                h.update(key.encode())
                h.update(value.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # torchrun's restarts of the workers so far


def _now(fault: dict[str, Any]) -> bool:
    """Whether ``fault`` fires in this attempt."""
    return int(fault.get("attempt", 0)) == ATTEMPT


class FaultyTrainer(BaseTrainer[Any]):
    """BaseTrainer that fires the payload's faults and records every finished step."""

    def __init__(self, faults: list[dict[str, Any]], out_dir: Path, **kwargs: Any) -> None:
        self.faults = faults
        self.rank = kwargs["context"].topology.global_rank
        self.steps_file = out_dir / f"steps_rank{self.rank}.jsonl"
        super().__init__(**kwargs)

    def due(self, kind: str) -> dict[str, Any] | None:
        step = self.context.iterations + 1
        for fault in self.faults:
            if fault["kind"] == kind and fault["rank"] == self.rank and fault.get("step") == step and _now(fault):
                return fault
        return None

    def train_step(self) -> dict[str, Any]:
        if fault := self.due("exit"):
            print(f"fault: rank {self.rank} exits with {fault['code']} at step {fault['step']}", flush=True)
            os._exit(fault["code"])
        hooks = []
        if self.due("inf_grad"):
            weight = next(p for _, p, _ in self.parallel_module.named_parameters_with_meta())
            hooks.append(weight.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf"))))
        metrics = super().train_step()
        for hook in hooks:
            hook.remove()
        record = {
            "step": self.context.iterations,
            "attempt": ATTEMPT,
            "time": time.time(),
            "loss": metrics["training/loss"],
            "skipped": metrics.get("training/global_grad_norm") is None,
            "hash": state_hash(self.parallel_module, self.optimizer),
        }
        with open(self.steps_file, "a") as f:
            f.write(json.dumps(record) + "\n")
        return metrics


def run(payload: dict[str, Any]) -> None:
    """One rank's training under ``payload`` (torchrun's environment, or a pooled test rank's)."""
    torch.set_num_threads(1)
    out_dir = Path(payload["out_dir"])
    config = ReliabilityConfig.from_dict(payload["config"])
    faults = payload.get("faults", [])
    step_delay_s = float(payload.get("step_delay_s", 0.0))
    topology = Topology.from_env(config.topology)
    rank = topology.global_rank
    record = {
        "rank": rank,
        "pid": os.getpid(),
        "pipe_rank": topology.axis("pp").rank,
        "env_sha256": {
            k: hashlib.sha256(os.environ[k].encode()).hexdigest() if k in os.environ else None
            for k in payload.get("echo_env_hash", [])
        },
    }
    (out_dir / f"rank{rank}.json").write_text(json.dumps(record))
    context = BaseContext(config=config, topology=topology)
    context.initialize(seed=config.trainer.seed)
    module = ParallelModule(
        [LayerSpec(Hidden, topology=topology), LayerSpec(Head, topology=topology)], topology, seed=1
    )
    group = OptimizerParamGroup(
        named_parameters_with_meta=list(module.named_parameters_with_meta()),
        config=OptimizerParamGroupConfig(name="all", weight_decay=0.01),
    )
    optimizer = Optimizer(config.optimizer, [group], topology)
    dataset = Blobs(512)

    def loss_function(out: IO, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        step = context.iterations + 1
        for fault in faults:
            if fault["rank"] != rank or fault.get("step") != step or not _now(fault):
                continue
            if fault["kind"] == "sigkill":
                save_dir = config.trainer.save_dir
                if fault.get("hide_save_dir") and save_dir is not None:
                    save_dir.rename(save_dir.with_name(save_dir.name + ".hidden"))
                print(f"fault: rank {rank} SIGKILLs itself in step {step}", flush=True)
                (out_dir / f"fault_rank{rank}.time").write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            if fault["kind"] == "signal":
                (out_dir / f"fault_rank{rank}.time").write_text(repr(time.time()))
                os.kill(os.getpid(), fault["signum"])
            elif fault["kind"] == "sleep":
                print(f"fault: rank {rank} sleeps {fault['seconds']} s in step {step}", flush=True)
                (out_dir / f"fault_rank{rank}.time").write_text(repr(time.time()))
                time.sleep(fault["seconds"])
        if step_delay_s:
            time.sleep(step_delay_s)
        loss = F.cross_entropy(out.h, batch.y)
        if any(f["kind"] == "nan_loss" and f["rank"] == rank and f["step"] == step for f in faults):
            loss = loss * float("nan")
        return loss, {}

    for fault in faults:
        if fault["kind"] == "kill_in_memory_load" and fault["rank"] == rank and _now(fault):
            from scaling.trainer.checkpoint._memory import MemoryCheckpoints

            def load_and_die(*args: Any, **kwargs: Any) -> Any:
                print(f"fault: rank {rank} SIGKILLs itself while loading its in-memory checkpoint", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

            MemoryCheckpoints.load = load_and_die  # type: ignore[method-assign]
        if fault["kind"] == "kill_in_save" and fault["rank"] == rank:
            from scaling.trainer.checkpoint import _save

            # _save._commit runs once this rank's shards are written and before anyone writes the
            # marker (whether the shards were hashed while written or are hashed there).
            real_commit, target = _save._commit, _save.mk.step_dir_name(fault["step"])

            def commit_or_die(
                save_dir: Path, step_dir: Path, *args: Any, real_commit: Any = real_commit, target: str = target
            ) -> Any:
                if Path(step_dir).name == target:
                    print(f"fault: rank {rank} SIGKILLs itself while committing {target}", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
                return real_commit(save_dir, step_dir, *args)

            _save._commit = commit_or_die

    try:
        trainer = FaultyTrainer(
            faults,
            out_dir,
            config=config.trainer,
            context=context,
            parallel_module=module,
            optimizer=optimizer,
            dataset=dataset,
            dataset_evaluation=None,
            sync_batch_to_model_parallel=dataset.sync_batch_to_model_parallel,
            metrics_aggregation_fn=None,
            loss_function=loss_function,
        )
        trainer.run_training()
    except Exception as exc:
        (out_dir / f"error_rank{rank}.txt").write_text(f"{type(exc).__name__}: {exc}")
        raise
    topology.destroy()
    for fault in faults:
        if fault["kind"] == "exit" and fault["rank"] == rank and fault["step"] > config.trainer.train_iterations:
            print(f"fault: rank {rank} exits with {fault['code']} after training", flush=True)
            sys.exit(fault["code"])


def main() -> None:
    run(load_payload())


if __name__ == "__main__":
    main()  # raises, or exits with a fault's code, on the other paths
    # Everything this rank writes is closed by now: skip the interpreter's teardown (see the top).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
