"""``python -m gravac``: the same command line as the ``gravac`` script."""

from __future__ import annotations

from gravac.cli import main

__all__: list[str] = []

if __name__ == "__main__":
    raise SystemExit(main())
