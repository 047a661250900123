"""``python -m qasr ...``: the ``qasr`` command, for environments where its script is not on PATH."""

from qasr.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
