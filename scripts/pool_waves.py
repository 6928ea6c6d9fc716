#!/usr/bin/env python3
"""Plugin vs built-in over several interleaved benchmark runs: paired waves pooled.

The same as ``python -m sglang_dflash.bench.pool``, with the package installed (``pip install -e .``);
``--help`` lists the options.
"""

import sys

from sglang_dflash.bench.pool import main

if __name__ == "__main__":
    sys.exit(main())
