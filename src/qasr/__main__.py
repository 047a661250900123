"""``python -m qasr``: the ``qasr`` command."""

from qasr.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
