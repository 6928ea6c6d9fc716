#!/usr/bin/env python3
"""Accept length of a draft without a server (the pure-torch reference loop).

The same as ``python -m sglang_dflash.bench.offline_accept_length``, with the package installed (``pip install -e .``);
``--help`` lists the options.
"""

import sys

from sglang_dflash.bench.offline_accept_length import main

if __name__ == "__main__":
    sys.exit(main())
