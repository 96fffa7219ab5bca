"""Write requirements/<name>.txt for every package and app: it, its sibling closure from this
checkout, and torch pinned to the CPU wheel where the closure needs torch.

    python tools/requirements.py           # (re)write the files
    python tools/requirements.py --check   # exit 1 naming the files that are not current

The packages are not on a package index, so ``pip install scaling-nn`` cannot resolve their
siblings; ``pip install -r requirements/nn.txt`` installs scaling-nn with exactly the siblings
its pyproject declares, from the checkout. A bare ``torch`` would pull several GB of CUDA
wheels, hence the pin. tests/test_requirements.py keeps the files current.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
TORCH = "torch==2.13.0"
# Dependency order (ARCHITECTURE.md's layering), for files that read top-down.
ORDER = [
    "scaling-config", "scaling-topology", "scaling-collectives", "scaling-nn", "scaling-optim", "scaling-pipeline",
    "scaling-data", "scaling-trainer", "scaling-runner", "scaling-testing", "scaling-mlp", "scaling-transformer",
]  # fmt: skip


def dists() -> dict[str, Path]:
    found = {}
    for pyproject in sorted([*ROOT.glob("packages/*/pyproject.toml"), *ROOT.glob("apps/*/pyproject.toml")]):
        found[tomllib.loads(pyproject.read_text())["project"]["name"]] = pyproject.parent
    return found


def _deps(path: Path) -> list[str]:
    deps = tomllib.loads((path / "pyproject.toml").read_text())["project"].get("dependencies", [])
    return [re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0] for d in deps]


def closure(name: str, found: dict[str, Path]) -> tuple[list[str], bool]:
    """The sibling distributions ``name`` needs (itself included, in dependency order), and whether any needs torch."""
    seen, todo, torch = set(), [name], False
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        for dep in _deps(found[current]):
            torch |= dep == "torch"
            if dep in found:
                todo.append(dep)
    return sorted(seen, key=lambda d: ORDER.index(d) if d in ORDER else len(ORDER)), torch


def file_name(name: str) -> str:
    return f"{name.removeprefix('scaling-')}.txt"


def render(name: str, found: dict[str, Path]) -> str:
    members, torch = closure(name, found)
    lines = [
        f"# {name} alone, from this checkout: it and the sibling packages it declares"
        + (" (torch pinned to the CPU wheel:" if torch else "."),
    ]
    if torch:
        lines.append("# a bare `torch` would pull several GB of CUDA wheels). Written by tools/requirements.py.")
        lines.append(TORCH)
    else:
        lines.append("# Written by tools/requirements.py.")
    lines += [f"./{found[m].relative_to(ROOT).as_posix()}" for m in members]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    found = dists()
    stale = []
    for name in found:
        path = ROOT / "requirements" / file_name(name)
        text = render(name, found)
        if "--check" in argv:
            if not path.is_file() or path.read_text() != text:
                stale.append(str(path.relative_to(ROOT)))
        else:
            path.write_text(text)
    if stale:
        print(f"not current: {', '.join(stale)}; run python tools/requirements.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
