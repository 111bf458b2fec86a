"""``python -m streamwatch``: the same command line as the ``streamwatch`` console script."""

import sys

from streamwatch.cli import main

if __name__ == "__main__":
    sys.exit(main())
