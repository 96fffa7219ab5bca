"""Property test over topology and architecture configs: refused with names and values, or a sound grid."""

from __future__ import annotations

import math
import re

from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from scaling.mlp.config import MLPConfig
from scaling.pipeline._partition import partition_layers
from scaling.topology import Topology

sizes = st.one_of(st.none(), st.integers(-1, 9))


@settings(max_examples=300, deadline=None)
@given(
    world=sizes, tp=sizes, pp=sizes, dp=sizes, gbs=sizes, mbs=sizes, acc=sizes,
    hidden=st.integers(-1, 40), blocks=st.integers(-1, 4),
)  # fmt: skip
def test_every_config_is_refused_with_field_and_value_or_yields_a_sound_grid(
    world, tp, pp, dp, gbs, mbs, acc, hidden, blocks
):
    topology = {
        "world_size": world, "model_parallel_size": tp, "pipe_parallel_size": pp, "data_parallel_size": dp,
        "global_batch_size": gbs, "micro_batch_size": mbs, "gradient_accumulation_steps": acc, "device": "cpu",
    }  # fmt: skip
    raw = {
        "runner": {"runner_type": "local"},
        "topology": {k: v for k, v in topology.items() if v is not None},
        "architecture": {"hidden_size": hidden, "num_blocks": blocks},
    }
    try:
        cfg = MLPConfig.from_dict(raw)
    except ValidationError as err:
        message = str(err)
        # Each error names a field and the value it got (pydantic's "Input should be ..." names
        # the field's location and the input value; our own checks write field=value).
        assert re.search(r"(\w+=-?\d+)|(\n\w[\w.]*\n  Input should be .*input_value=)", message), message
        return
    t = cfg.topology
    assert t.world_size == t.model_parallel_size * t.pipe_parallel_size * t.data_parallel_size
    if t.global_batch_size is not None:
        assert t.global_batch_size == t.micro_batch_size * t.gradient_accumulation_steps * t.data_parallel_size
    # The rank grid (no process group needed): every rank has distinct coordinates in range.
    coords = {Topology(t, r).coordinates() for r in range(t.world_size)}
    assert len(coords) == t.world_size
    assert math.prod((t.pipe_parallel_size, t.data_parallel_size, t.model_parallel_size)) == t.world_size
    # Every pipeline stage gets at least one of the model's layers.
    stages = partition_layers(2 * cfg.architecture.num_blocks, t.pipe_parallel_size)
    assert len(stages) == t.pipe_parallel_size and all(len(s) > 0 for s in stages)
    assert cfg.architecture.hidden_size % t.model_parallel_size == 0
