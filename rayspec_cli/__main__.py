"""`python -m rayspec_cli ...`: the `rayspec` command without the console script."""

import sys

from rayspec_cli.main import main

sys.exit(main())
