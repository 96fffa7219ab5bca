"""The READMEs' Python examples run as written, and where a print's comment says what it prints, it does.

Each README's ``python`` blocks run in order in one fresh process (in an empty folder). A
``print(...)  # text`` comment must start with the printed line (an explanation may follow) in
the READMEs listed in CHECKED. READMEs whose examples need a
launcher, a config file on the command line or downloaded weights (runner, trainer,
transformer) are not run here; their commands are tested where they are used.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNNABLE = ["collectives", "config", "data", "nn", "optim", "pipeline", "testing", "topology"]
CHECKED = {"config", "nn", "topology"}

_RUNNER = r"""
import ast, contextlib, io, json, re, sys
text = open(sys.argv[1]).read()
ns, report = {}, []
for block in re.findall(r"```python\n(.*?)```", text, re.S):
    lines = block.splitlines()
    expected = sorted(
        (node.lineno, lines[node.end_lineno - 1].split("  # ", 1)[1])
        for node in ast.walk(ast.parse(block))
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
        and getattr(node.value.func, "id", "") == "print" and "  # " in lines[node.end_lineno - 1]
    )
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block, sys.argv[1], "exec"), ns)
    report.append({"printed": out.getvalue().splitlines(), "expected": [e for _, e in expected]})
print(json.dumps(report))
"""


@pytest.mark.slow  # a process per README (torch imported in each)
@pytest.mark.parametrize("name", RUNNABLE)
def test_a_readmes_python_examples_run_as_written(name, tmp_path):
    readme = ROOT / "packages" / f"scaling-{name}" / "README.md"
    done = subprocess.run(
        [sys.executable, "-c", _RUNNER, str(readme)], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    if name not in CHECKED:
        return
    import json

    for block in json.loads(done.stdout.splitlines()[-1]):
        printed = block["printed"][: len(block["expected"])]
        assert len(printed) == len(block["expected"]), block
        assert all(p and e.startswith(p) for p, e in zip(printed, block["expected"])), block
