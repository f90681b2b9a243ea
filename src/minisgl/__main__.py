"""`python -m minisgl`: the command line (minisgl.cli.main)."""

import sys

from minisgl.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
