"""Nox sessions for the Scaling monorepo.

    nox -s tests                      # whole suite, every package editable in one venv (README/CI)
    nox -s package_tests              # each package alone with its declared sibling closure
    nox -s install_alone              # each package's README install command, fresh env, all modules imported
    nox -s "package_tests(package='scaling-nn')"
    nox -s torch_matrix               # only the leg of the local torch; `-- all` runs every leg
    nox -s lint typecheck layering build

torch is always installed by exact version first: a bare `torch` requirement would pull
the newest CUDA build (several GB) where a CPU wheel of the pinned version is at hand.
"""

from __future__ import annotations

import os
import re
import zipfile
from pathlib import Path

import nox
import tomllib

ROOT = Path(__file__).parent
LOCAL_TORCH = "2.13.0"
# 2.11.0: the torch of the GPU machines scripts/gpu_check runs on.
TORCH_LEGS = ["2.6.0", "2.11.0", LOCAL_TORCH, "newest"]
TEST_TOOLS = ["pytest>=8", "pytest-timeout>=2", "pytest-xdist>=3.6", "hypothesis>=6"]
# Optional extras some packages' tests exercise (PEFT interop, the tokenizer build command,
# the W&B sink, schedule plots).
TEST_EXTRAS = {
    "scaling-nn": "test",
    "scaling-data": "build",
    "scaling-trainer": "wandb",
    "scaling-pipeline": "plot",
    "scaling-transformer": "hf",
}

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True


def _dists() -> dict[str, Path]:
    """Distribution name -> folder, for every package and app in the repo."""
    found = {}
    for pyproject in sorted([*ROOT.glob("packages/*/pyproject.toml"), *ROOT.glob("apps/*/pyproject.toml")]):
        name = tomllib.loads(pyproject.read_text())["project"]["name"]
        found[name] = pyproject.parent
    return found


def _sibling_closure(name: str, dists: dict[str, Path]) -> list[str]:
    """``name`` plus every sibling distribution it depends on, transitively."""
    seen: list[str] = []
    todo = [name]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.append(current)
        deps = tomllib.loads((dists[current] / "pyproject.toml").read_text())["project"].get("dependencies", [])
        for dep in deps:
            dep_name = re.split(r"[<>=!~\[; ]", dep, maxsplit=1)[0]
            if dep_name in dists:
                todo.append(dep_name)
    return seen


def _requirement(name: str, path: Path, editable: bool) -> list[str]:
    extra = TEST_EXTRAS.get(name)
    spec = f"{path}[{extra}]" if extra else str(path)
    return ["-e", spec] if editable else [spec]


def _all_editable(dists: dict[str, Path]) -> list[str]:
    return [arg for name, path in dists.items() for arg in _requirement(name, path, editable=True)]


def _install_torch(session: nox.Session, version: str = LOCAL_TORCH) -> None:
    # --no-compile: byte-compiling torch's ~15k modules at install costs minutes on two
    # cores; the test runs compile the few they import on first use instead (_pytest).
    session.install("--no-compile", f"torch=={version}" if version != "newest" else "torch")


# The torch modules the suite's processes import (torchrun's agent, DCP, DTensor, and dynamo,
# which DTensor construction and transformers' models pull in), and the transformers models and
# peft that conftest.py preloads in every pytest worker.
_WARM_IMPORTS = (
    "import torch, torch.distributed.run, torch.distributed.checkpoint, torch.distributed.tensor, torch._dynamo, "
    "transformers.models.llama.modeling_llama, transformers.models.gpt2.modeling_gpt2, peft"
)


def _pytest(session: nox.Session, *args: str) -> None:
    """pytest with bytecode caching on, whatever the caller's PYTHONDONTWRITEBYTECODE.

    With it set (as on this project's machines) and torch installed --no-compile, every
    process recompiled torch from source on import: 7.4 s instead of 3.5 s for ``import
    torch`` alone, in each of the hundreds of processes the suite launches (workers,
    torchrun, the runner). One process first imports the torch modules the suite uses and
    writes their .pyc files (the install step pip's byte-compilation would be, for the
    modules used only), so the suite's first processes do not each compile them at once.
    """
    env = {"PYTHONDONTWRITEBYTECODE": ""}
    session.run("python", "-c", _WARM_IMPORTS, env=env, silent=True)
    session.run("python", "-m", "pytest", *args, env=env)


def _parallel() -> list[str]:
    """pytest-xdist arguments: two workers more than there are cores, tests handed out one by one.

    Many tests wait rather than compute (gloo handshakes, process launches, torchrun and
    SLURM start-up, timeouts waited out on purpose), so extra workers fill the two cores of
    this project's machines. On 2026-11-25 (e19861e, a suite of 3 minutes) 3 workers were
    best; on 2026-11-28 (6196956, 1,149 tests, its long tests launching whole runs) the
    whole suite took 18 min 6 s with 4 workers against 22 to 24 min with 3 the day before.
    ``--maxschedchunk 1`` hands out one test at a time, so the long tests (run first, see
    conftest.py) spread over the workers instead of queueing on one. Capped at 6: every
    worker keeps its own pool of up to eight ranks. ``-- -n 0`` on the nox command line runs
    serially.
    """
    workers = min((os.cpu_count() or 1) + 2, 6)
    return ["-n", str(workers), "--maxschedchunk", "1"]


def _test_paths(dists: dict[str, Path]) -> list[str]:
    paths = [str(p / "tests") for p in dists.values() if (p / "tests").is_dir()]
    if (ROOT / "tests").is_dir():
        paths.append("tests")
    return paths


@nox.session
def tests(session: nox.Session) -> None:
    """The whole suite with every package installed editable in one environment."""
    dists = _dists()
    _install_torch(session)
    # --no-compile here too: transformers alone is ~2,000 modules, of which the suite imports a
    # few dozen (compiled by _pytest's warm-up instead).
    session.install("--no-compile", *TEST_TOOLS, *_all_editable(dists))
    # --durations: the CI log ends with the slowest tests, where a trim of the suite starts.
    _pytest(session, *_test_paths(dists), *_parallel(), "--durations=25", *session.posargs)


@nox.session
@nox.parametrize("package", sorted(_dists()))
def install_alone(session: nox.Session, package: str) -> None:
    """A package's README install command in a fresh environment (``pip install -r
    requirements/<name>.txt``: it, its declared siblings, the CPU torch), then every module imported."""
    session.install("--no-compile", "-r", f"requirements/{package.removeprefix('scaling-')}.txt")
    session.run("python", str(ROOT / "tools" / "import_all.py"), str(_dists()[package] / "src"))


@nox.session
@nox.parametrize("package", sorted(_dists()))
def package_tests(session: nox.Session, package: str) -> None:
    """One package alone (its declared sibling closure only) in a fresh environment."""
    dists = _dists()
    _install_torch(session)
    session.install(*TEST_TOOLS)
    closure = _sibling_closure(package, dists)
    # scaling-testing is the harness every package's tests use; it is a test tool, not a
    # runtime dependency, so it is added here rather than declared by the package.
    for extra in _sibling_closure("scaling-testing", dists):
        if extra not in closure:
            closure.append(extra)
    session.install(*[arg for d in closure for arg in _requirement(d, dists[d], editable=False)])
    tests_dir = dists[package] / "tests"
    if tests_dir.is_dir():
        _pytest(session, str(tests_dir), "-p", "no:cacheprovider", *session.posargs)
    # Every module of the package must import with only the declared dependencies.
    session.run("python", str(ROOT / "tools" / "import_all.py"), str(dists[package] / "src"))


@nox.session
@nox.parametrize("torch", TORCH_LEGS)
def torch_matrix(session: nox.Session, torch: str) -> None:
    """The suite against one torch version. Only the local leg runs unless `-- all` is passed."""
    run_all = "all" in session.posargs
    if torch != LOCAL_TORCH and not run_all:
        session.skip(f"torch {torch}: pass `-- all` to run the non-local legs (they download torch)")
    dists = _dists()
    _install_torch(session, torch)
    session.install(*TEST_TOOLS, *_all_editable(dists))
    session.run("python", "-c", "import torch; print('torch', torch.__version__)")
    # No -x: a compatibility leg lists every failure, not the first.
    _pytest(session, *_test_paths(dists), *_parallel(), "-q", *[a for a in session.posargs if a != "all"])


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy, strict on every package and app (pyproject.toml's [tool.mypy]); CI runs it beside the tests.

    The packages are read from their src/ folders (MYPYPATH), not installed, and of their
    dependencies only those whose types the code leans on are: torch, pydantic (its mypy
    plugin reads the configs), numpy and PyYAML's stubs. The optional ones (transformers,
    peft, safetensors, tokenizers, wandb, ...) are left out: their imports type as Any
    (``ignore_missing_imports``), and the session takes ~1 min instead of ~3 (measured
    2026-11-27: the same "no issues" either way).
    """
    dists = _dists()
    _install_torch(session)
    session.install("--no-compile", "mypy", "types-PyYAML", "pydantic>=2.6,<3", "numpy", "pyyaml")
    # One namespace over many src/ roots: mypy needs them all on MYPYPATH and the
    # packages named with -p (passing the folders makes it see each file twice).
    srcs = [p / "src" for p in dists.values()]
    packages = [f"scaling.{d.name}" for src in srcs for d in sorted((src / "scaling").iterdir()) if d.is_dir()]
    session.run("mypy", *[arg for name in packages for arg in ("-p", name)], env={"MYPYPATH": ":".join(map(str, srcs))})


@nox.session
def layering(session: nox.Session) -> None:
    """The dependency order of ARCHITECTURE.md, enforced by import-linter (.importlinter)."""
    dists = _dists()
    # import-linter reads the source statically: the packages only need to be findable on
    # the path, not installed with their dependencies (no torch download, no editable builds).
    session.install("import-linter")
    session.run("lint-imports", env={"PYTHONPATH": os.pathsep.join(str(p / "src") for p in dists.values())})


@nox.session
def build(session: nox.Session) -> None:
    """A wheel per package; fails if any wheel ships scaling/__init__.py (breaks PEP 420)."""
    session.install("build")
    out = Path(session.create_tmp()) / "wheels"
    dists = _dists()
    for path in dists.values():
        session.run("python", "-m", "build", "--wheel", "--outdir", str(out), str(path), silent=True)
    bad = []
    for wheel in sorted(out.glob("*.whl")):
        names = zipfile.ZipFile(wheel).namelist()
        if "scaling/__init__.py" in names:
            bad.append(wheel.name)
    if bad:
        session.error(f"wheels ship scaling/__init__.py and would break the namespace: {bad}")
    session.log(f"built {len(list(out.glob('*.whl')))} wheels, none ships scaling/__init__.py")
