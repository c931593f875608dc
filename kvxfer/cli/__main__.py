"""`python -m kvxfer.cli`: the `kvxfer` command."""

import sys

from kvxfer.cli import main

sys.exit(main())
