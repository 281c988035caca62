import sys

from ._cli.cli import main

sys.exit(main())
