"""``python -m nnstat.demo``: the same as ``nnstat demo``."""

import sys

from nnstat.demo.train import main

sys.exit(main(sys.argv[1:]))
