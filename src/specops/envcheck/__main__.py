"""`python -m specops.envcheck --plan|--run`: the stage protocol of specops.stage over stdin and stdout."""

from specops.envcheck.stage import main

raise SystemExit(main())
