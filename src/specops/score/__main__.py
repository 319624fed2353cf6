"""`python -m specops.score --plan|--run`: the stage protocol of specops.stage over stdin and stdout."""

from specops.score.stage import main

raise SystemExit(main())
