"""``scaling-check numerics``: run an app's config under two settings and name the first divergence.

    scaling-check numerics transformer my.yml --a topology.data_parallel_size=2 \\
        --b topology.data_parallel_size=2 transformer_architecture.precision=bf16 --steps 2

Each side is the config with its overrides, validated here by the app's launch checks (before any
process starts), then run by ``torchrun`` on this machine with as many processes as its topology
has ranks. The
report goes to stdout; the exit status is 0 when every quantity agrees, 1 at a divergence,
2 for a bad invocation or config.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from scaling.trainer.numerics._apps import APPS


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="scaling-check", description="Checks that localise a problem in a run.")
    sub = parser.add_subparsers(dest="command", required=True)
    numerics = sub.add_parser(
        "numerics",
        help="name the first module where two layouts or precisions diverge",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    numerics.add_argument("app", help=f"{', '.join(APPS)}, or 'pkg.config:ConfigClass,pkg.train:build_trainer'")
    numerics.add_argument("config", help="the app's YAML or JSON config (both sides start from it)")
    numerics.add_argument("--a", nargs="*", default=[], metavar="KEY=VALUE", help="overrides of side a")
    numerics.add_argument("--b", nargs="*", default=[], metavar="KEY=VALUE", help="overrides of side b")
    numerics.add_argument("--steps", type=int, default=2, help="optimizer steps to record (default 2)")
    numerics.add_argument("--out", default=None, help="keep the traces (a.pt, b.pt) in this folder")
    numerics.add_argument("--timeout", type=float, default=600, help="seconds each side may run (default 600)")
    return parser


def _side(app: str, path: str, overrides: list[str]) -> tuple[dict[str, object], int, str]:
    """The resolved config of one side, its process count and a description of its layout."""
    from scaling.trainer.numerics._apps import CHECKS, attribute, resolve_app

    config_class, _ = resolve_app(app)
    config = config_class.from_file(path, overrides=overrides)
    world = config.topology.world_size
    if app in CHECKS:  # the app's own launch checks, with the process count this command starts
        config = attribute(CHECKS[app])(path, [*overrides, f"runner.nproc_per_node={world}"])
    layout = " ".join(overrides) or "the config as given"
    return config.as_dict(), int(world), layout


def run_side(
    app: str, payload: dict[str, object], world: int, layout: str, out: Path, steps: int, timeout: float
) -> None:
    """Run one side under torchrun; raises ``RuntimeError`` naming the side when it fails."""
    out.unlink(missing_ok=True)
    config_file = out.with_suffix(".json")
    config_file.write_text(json.dumps(payload))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
        "-m", "scaling.trainer.numerics._worker", app, str(config_file), str(steps), str(out), "--layout", layout,
    ]  # fmt: skip
    done = subprocess.run(cmd, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0 or not out.is_file():
        raise RuntimeError(f"side {layout!r} failed (torchrun exit status {done.returncode}); its output is above")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.steps < 1:
        print(f"scaling-check: --steps={args.steps}; record at least 1 step", file=sys.stderr)
        return 2
    try:
        sides = [_side(args.app, args.config, overrides) for overrides in (args.a, args.b)]
    except (ValueError, FileNotFoundError, ImportError) as exc:
        print(f"scaling-check: invalid app or config: {exc}", file=sys.stderr)
        return 2
    from scaling.trainer.numerics._compare import compare
    from scaling.trainer.numerics._record import Trace

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.out or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        traces = []
        for name, (payload, world, layout) in zip("ab", sides):
            print(f"scaling-check: side {name} ({layout}) on {world} process(es)", flush=True)
            try:
                run_side(args.app, payload, world, layout, folder / f"{name}.pt", args.steps, args.timeout)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                print(f"scaling-check: {exc}", file=sys.stderr)
                return 2
            traces.append(Trace.load(str(folder / f"{name}.pt")))
    report = compare(traces[0], traces[1])
    print(report.describe())
    return 0 if report.first is None else 1


if __name__ == "__main__":
    sys.exit(main())
