#!/usr/bin/env python3
"""Plot loss and accuracy of training runs from their train_log.jsonl files.

The same as ``python -m sglang_dflash.train.plot``, with the package installed (``pip install -e .``);
``--help`` lists the options.
"""

import sys

from sglang_dflash.train.plot import main

if __name__ == "__main__":
    sys.exit(main())
