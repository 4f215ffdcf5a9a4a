"""`python -m scalebench`: the same as the `scalebench` command."""

from .cli import main

raise SystemExit(main())
