#!/usr/bin/env python3
"""Where a decode step's time goes: plugin DFLASH vs the built-in, on the same work.

The same as ``python -m sglang_dflash.bench.profile_step``, with the package installed (``pip install -e .``);
``--help`` lists the options.
"""

import sys

from sglang_dflash.bench.profile_step import main

if __name__ == "__main__":
    sys.exit(main())
