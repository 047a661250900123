"""``python -m qasr.cli``: the same as ``python -m qasr``."""

from qasr.cli.main import main

raise SystemExit(main())
