"""`python -m gouache.cli`: the `gouache` command."""

import sys

from gouache.cli import main

sys.exit(main())
