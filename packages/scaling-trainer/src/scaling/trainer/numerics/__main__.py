"""``python -m scaling.trainer.numerics`` is ``scaling-check``."""

import sys

from scaling.trainer.numerics._cli import main

sys.exit(main())
