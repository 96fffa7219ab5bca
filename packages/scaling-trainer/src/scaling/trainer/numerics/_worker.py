"""One side of ``scaling-check numerics``, run by torchrun on every rank: build the app's trainer
from the resolved config, record ``steps`` steps, and write the trace (global rank 0)."""

from __future__ import annotations

import argparse
import json

from scaling.topology import Topology
from scaling.trainer.numerics._apps import resolve_app
from scaling.trainer.numerics._record import NumericsRecorder


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m scaling.trainer.numerics._worker")
    parser.add_argument("app")
    parser.add_argument("config", help="the resolved config, as JSON")
    parser.add_argument("steps", type=int)
    parser.add_argument("out", help="where global rank 0 writes the trace")
    parser.add_argument("--layout", default=None)
    args = parser.parse_args(argv)
    config_class, build_trainer = resolve_app(args.app)
    with open(args.config) as f:
        config = config_class.from_dict(json.load(f))
    topology = Topology.from_env(config.topology)
    try:
        trace = NumericsRecorder(build_trainer(config, topology), layout=args.layout).run(args.steps)
        if trace is not None:
            trace.save(args.out)
    finally:
        topology.destroy()


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    record(main)()
