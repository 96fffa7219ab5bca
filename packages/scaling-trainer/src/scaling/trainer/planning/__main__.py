"""``python -m scaling.trainer.planning profile --out FILE``: measure this machine's profile."""

import sys

from scaling.trainer.planning._profile import main

sys.exit(main())
