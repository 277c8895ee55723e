"""`python -m meshloom ...`: the same as the `meshloom` command."""

import sys

from meshloom.commands import main

sys.exit(main())
