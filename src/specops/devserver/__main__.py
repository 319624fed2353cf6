import sys

from specops.devserver.cli import main

sys.exit(main())
