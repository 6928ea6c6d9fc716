"""``python -m sglang_dflash.bench``: the benchmark (``sglang-dflash-bench``)."""

import sys

from .sweep import main

sys.exit(main())
