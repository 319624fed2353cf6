"""`python -m specops.completions --plan|--run`: the stage protocol of specops.stage over stdin and stdout."""

from specops.completions.stage import main

raise SystemExit(main())
