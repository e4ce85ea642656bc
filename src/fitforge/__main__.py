"""``python -m fitforge``: the ``fitforge`` command (see :mod:`fitforge.cli`)."""

from fitforge.cli import main

raise SystemExit(main())
