"""``python -m stabledrl_mcore.demo`` (``make demo``): kept as the documented entry point of
:mod:`stabledrl_mcore.cli.demo`."""

from stabledrl_mcore.cli.demo import main

if __name__ == "__main__":
    raise SystemExit(main())
