"""`python -m minisgl` and the `minisgl` console script."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    print("minisgl: the CLI (serve, chat, bench) is not built yet.", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
