"""`python -m scaling.mlp CONFIG [dotted overrides]`: launch the MLP training.

python -m scaling.mlp apps/mlp/config.yml
python -m scaling.mlp apps/mlp/config.yml trainer.train_iterations=50 topology.data_parallel_size=1
python -m scaling.mlp --template            # the whole config, commented
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported when used: torch takes seconds to import, the first line does not wait
    from scaling.mlp.config import MLPConfig

DEFAULT_CONFIG = Path(__file__).with_name("config.yml")


def load_config(path: str | Path, overrides: list[str]) -> MLPConfig:
    """Validate the config and the process count before anything launches."""
    from scaling.mlp.config import MLPConfig
    from scaling.mlp.data import MNISTDataset

    config = MLPConfig.from_file(path, overrides=overrides)
    world_size = config.topology.world_size
    assert world_size is not None  # derived by TopologyConfig's validation when not given
    config.runner.check_world_size(world_size)
    if config.data.mnist_path is not None:
        # Read (and so check) the IDX files here, not in eight processes after launch.
        for train in (True, False):
            MNISTDataset(train=train, mnist_path=config.data.mnist_path)
    return config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scaling.mlp", description=__doc__.splitlines()[0])
    parser.add_argument(
        "config", nargs="?", default=str(DEFAULT_CONFIG), help="YAML or JSON config (default: the bundled one)"
    )
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.train_iterations=50")
    parser.add_argument("--template", action="store_true", help="print the commented config template and exit")
    args = parser.parse_args(argv)
    if args.template:
        from scaling.mlp.config import MLPConfig

        print(MLPConfig.template())
        return 0
    if "=" in args.config and not Path(args.config).exists():  # `python -m scaling.mlp trainer.x=1`
        args.overrides, args.config = [args.config, *args.overrides], str(DEFAULT_CONFIG)
    print(f"scaling.mlp: checking {args.config}" + (f" with {' '.join(args.overrides)}" if args.overrides else ""))
    sys.stdout.flush()
    try:
        config = load_config(args.config, args.overrides)
    except (ValueError, FileNotFoundError) as exc:
        print(f"scaling.mlp: invalid config: {exc}", file=sys.stderr)
        return 2
    from scaling.runner import runner_main

    print(f"scaling.mlp: launching {config.describe_launch()}", flush=True)
    return runner_main(config.runner, payload=config.as_dict(), exit_on_failure=False)


if __name__ == "__main__":
    sys.exit(main())
