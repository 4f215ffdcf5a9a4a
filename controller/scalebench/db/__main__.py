"""``python -m scalebench.db dbtrace ...``: the dbtrace command without the main CLI."""

import sys

from .cli import main

if (
    __name__ == "__main__"
):  # the guard matters: the tracer's spawned process imports the main module
    sys.exit(main())
