"""``scaling-run CONFIG [dotted.key=value ...] [--dry-run]`` (options anywhere on the line).

The config file (YAML or JSON) holds the whole application config; its ``runner``
section is validated as :class:`RunnerConfig` and the whole merged mapping, overrides
applied, is the payload every process receives.
"""

from __future__ import annotations

import argparse
import sys

from pydantic import ValidationError

from scaling.config import apply_overrides, load_mapping
from scaling.runner._config import RunnerConfig
from scaling.runner._main import runner_main


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="scaling-run",
        description="Launch a Scaling training script with torchrun locally, through pdsh (optionally in docker) "
        "or SLURM, as described by the config's 'runner' section.",
    )
    parser.add_argument("config", help="YAML or JSON config file with a 'runner' section")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. runner.nproc_per_node=4")
    parser.add_argument("--dry-run", action="store_true", help="print the commands per node and exit")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``scaling-run``; returns the process exit code."""
    # Intermixed: options may come after the config file and between overrides.
    args = _parser().parse_intermixed_args(argv)
    try:
        data = load_mapping(args.config)
    except (FileNotFoundError, ValueError) as exc:
        print(f"scaling-run: {exc}", file=sys.stderr)
        return 2
    if not isinstance(data.get("runner"), dict):
        print(f"scaling-run: {args.config!r} needs a top-level 'runner' mapping (see RunnerConfig)", file=sys.stderr)
        return 2
    try:
        data = apply_overrides(data, args.overrides)
        config = RunnerConfig.from_dict(data["runner"])
        return runner_main(config, payload=data, dry_run=args.dry_run, exit_on_failure=False)
    except (ValidationError, ValueError, TypeError) as exc:
        print(f"scaling-run: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
