#!/usr/bin/env python3
"""Abort and load stress against a running SGLang server.

The same as ``python -m sglang_dflash.bench.stress``, with the package installed (``pip install -e .``);
``--help`` lists the options.
"""

import sys

from sglang_dflash.bench.stress import main

if __name__ == "__main__":
    sys.exit(main())
