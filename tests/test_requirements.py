"""requirements/<name>.txt: each package's documented install from the checkout stays its declared closure."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_packages_requirements_file_is_its_declared_sibling_closure():
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools/requirements.py"), "--check"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


def test_every_package_readme_installs_with_its_requirements_file():
    for readme in sorted([*ROOT.glob("packages/*/README.md"), *ROOT.glob("apps/*/README.md")]):
        short = readme.parent.name.removeprefix("scaling-")
        assert f"pip install -r requirements/{short}.txt" in readme.read_text(), readme
