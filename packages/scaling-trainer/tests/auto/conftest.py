"""Makes this folder's helper module (auto_models) importable by name, here and in workers."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
