"""`python -m specops.extract --plan|--run`: the stage protocol of specops.stage over stdin and stdout.

The play waits on this process inside the service window, so it exits without the interpreter's
teardown (specops.stage.exit_now): every output is written and closed before main returns.
"""

from specops.extract.stage import main
from specops.stage import exit_now

exit_now(main())
