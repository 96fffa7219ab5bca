"""``Any`` in the packages' and apps' code: rare, and each use says why (issue #32, "types at the seams").

mypy (``nox -s typecheck``, strict) checks what is typed; an ``Any`` opts a value out of
that check, so each one must carry its reason: a comment that mentions ``Any`` on its line
or in the four lines above it (a ``#:`` comment over a type alias counts). The reasons in
use are listed in docs/architecture.md ("Types at the seams").
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The issue asked for fewer than 100 in packages/*/src; 32 remained there when it was met, and 7
# in the apps (2026-11-27). Raise this only together with the reason for the new use.
LIMIT = 50
REASON_WINDOW = 4  # lines above a use where its reason may stand


def _any_lines(path: Path) -> list[int]:
    """Lines of ``path`` that use the name ``Any`` (``Any`` or ``typing.Any``)."""
    lines = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Name) and node.id == "Any":
            lines.add(node.lineno)
        elif isinstance(node, ast.Attribute) and node.attr == "Any" and isinstance(node.value, ast.Name):
            lines.add(node.lineno)
    return sorted(lines)


def _unexplained(path: Path) -> list[int]:
    """Lines using ``Any`` with no comment mentioning ``Any`` on them or in the lines above."""
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    reasons = {tok.start[0] for tok in tokens if tok.type == tokenize.COMMENT and "Any" in tok.string}
    return [line for line in _any_lines(path) if not any(line - k in reasons for k in range(REASON_WINDOW + 1))]


SOURCES = sorted([*ROOT.glob("packages/*/src/**/*.py"), *ROOT.glob("apps/*/src/**/*.py")])


def test_any_is_rare() -> None:
    count = sum(len(_any_lines(path)) for path in SOURCES)
    assert count < LIMIT, (
        f"{count} uses of Any in packages/*/src and apps/*/src (limit {LIMIT}); type the new ones (a Protocol, a TypeVar, "
        "object for a value only passed on) or raise LIMIT with the reason"
    )


def test_each_any_has_its_reason() -> None:
    missing = [f"{path.relative_to(ROOT)}:{line}" for path in SOURCES for line in _unexplained(path)]
    assert not missing, (
        f"uses of Any without a comment saying why (on the line or the {REASON_WINDOW} above): {missing}"
    )


def test_the_check_finds_a_use_without_its_reason(tmp_path: Path) -> None:
    code = "from typing import Any\n\n\n{}def f(x: Any) -> None: ...\n"
    bare, explained = tmp_path / "bare.py", tmp_path / "explained.py"
    bare.write_text(code.format(""))
    explained.write_text(code.format("# Any: x is whatever the caller's callback takes.\n"))
    assert _unexplained(bare) == [4]
    assert _unexplained(explained) == []
