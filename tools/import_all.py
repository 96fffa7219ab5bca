"""Import every module under a package's src/ folder; exit 1 naming the ones that fail.

Run in an environment that holds only the package and its declared dependencies, this
proves the declared dependencies are complete.
"""

import importlib
import sys
import traceback
from pathlib import Path


def main(src: str) -> int:
    root = Path(src)
    failed = []
    count = 0
    for path in sorted(root.rglob("*.py")):
        module = ".".join(path.relative_to(root).with_suffix("").parts)
        if module.endswith("__main__"):
            continue
        module = module.removesuffix(".__init__")
        count += 1
        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001 - report every failure, not just the first
            failed.append((module, traceback.format_exc(limit=2)))
    for module, tb in failed:
        print(f"FAILED to import {module}:\n{tb}", file=sys.stderr)
    print(f"imported {count - len(failed)}/{count} modules under {src}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
