"""``python -m fp8kturbov COMMAND [options]``: the command line of `fp8kturbov.tools.cli`."""

import sys

from .tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
