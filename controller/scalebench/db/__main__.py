"""``python -m scalebench.db dbtrace ...``: the dbtrace command without the main CLI."""
import sys

from .cli import main

sys.exit(main())
