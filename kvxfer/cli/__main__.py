"""`python -m kvxfer.cli`: the `kvxfer` command."""

import sys

from kvxfer.cli import main

if __name__ == "__main__":  # importing the module (a walk of the package) runs nothing
    sys.exit(main())
