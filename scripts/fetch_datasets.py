#!/usr/bin/env python3
"""Fetch the benchmark prompt sets into the local cache (installed: sglang-dflash-fetch-datasets).

The same as ``python -m sglang_dflash.bench.datasets``, with the package installed (``pip install -e .``);
``--help`` lists the options.
"""

import sys

from sglang_dflash.bench.datasets import main

if __name__ == "__main__":
    sys.exit(main())
