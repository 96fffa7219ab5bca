"""Bad values for every user config; run as a script it prints each error (see test_config_under_O.py)."""

from __future__ import annotations

import json
import sys

CASES: list[tuple[str, dict]] = [
    ("scaling.topology:TopologyConfig", {"world_size": 6, "model_parallel_size": 4}),
    ("scaling.topology:TopologyConfig", {"world_size": 2, "global_batch_size": 9, "micro_batch_size": 2}),
    ("scaling.topology:TopologyConfig", {"world_size": 4, "data_parallel_shard_size": 3}),
    ("scaling.optim:OptimizerConfig", {"zero_stage": 7}),
    ("scaling.optim:OptimizerConfig", {"method": "lion"}),
    ("scaling.optim:LearningRateSchedulerConfig", {"learning_rate": 0.1, "learning_rate_minimum": 0.2}),
    ("scaling.trainer:TrainerConfig", {"train_iterations": 0}),
    ("scaling.trainer:TrainerConfig", {"train_iterations": True}),
    ("scaling.runner:RunnerConfig", {"runner_type": "pdsh", "hosts": ["a"], "hostsfile": "h.txt"}),
    ("scaling.runner:RunnerConfig", {"env": {"HF_TOKEN": "abcd1234"}}),
    ("scaling.mlp.config:MLPConfig", {"topology": {"model_parallel_size": 3}, "architecture": {"hidden_size": 256}}),
    ("scaling.mlp.config:MLPConfig", {"topology": {"pipe_parallel_size": 8}, "architecture": {"num_blocks": 1}}),
    (
        "scaling.mlp.config:MLPConfig",
        {"topology": {"data_parallel_size": 4, "data_parallel_shard_size": 2}, "optimizer": {"zero_stage": 1}},
    ),
    (
        "scaling.transformer.config:TransformerConfig",
        {"topology": {"model_parallel_size": 3}, "transformer_architecture": {"num_attention_heads": 8}},
    ),
    ("scaling.mlp.config:MLPConfig", {"topology": {"context_parallel_size": 2}}),
    (
        "scaling.transformer.config:TransformerConfig",
        {"topology": {"context_parallel_size": 4}, "data": {"sequence_length": 20}},
    ),
]


def errors() -> list[str]:
    """The error message of each case (every one must be refused)."""
    import importlib

    out = []
    for target, data in CASES:
        module, _, name = target.partition(":")
        cls = getattr(importlib.import_module(module), name)
        try:
            cls.from_dict(data)
        except ValueError as exc:
            out.append(f"{name}: {exc}")
        else:
            out.append(f"{name}: ACCEPTED {data}")
    return out


if __name__ == "__main__":
    json.dump(errors(), sys.stdout)
