"""Imported first by the workers' forkserver: its preload imports run without cyclic collection.

torch, DCP and Hugging Face's model classes leave hundreds of thousands of objects behind, and
the collections their imports trigger cost ~15 % of the import (~0.75 s of CPU per forkserver).
The forkserver only forks after that, so its collector stays off; each worker turns its own
back on once started (``_worker.worker_main``).
"""

import gc

gc.disable()
