"""`python -m specops.extract --plan|--run`: the stage protocol of specops.stage over stdin and stdout."""

import sys

from specops.extract.stage import main

sys.exit(main())
