"""Makes this folder's helper module (reliability_testlib) importable by name, here and in workers."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
