"""``python -m zpp ...``: the ``zpp`` command (see :mod:`zpp.cli`)."""
from zpp.cli import main

if __name__ == "__main__":  # not when multiprocessing re-imports it in a spawned rank
    raise SystemExit(main())
