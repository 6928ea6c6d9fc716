#!/usr/bin/env python3
"""Benchmark AR against DFLASH (plugin and built-in) on SGLang servers, from a checkout.

The benchmark lives in ``sglang_dflash.bench``; installed, it is the ``sglang-dflash-bench``
command (``--help`` lists every option). This file keeps ``python benchmark_sglang.py ...`` working.
"""

import sys

from sglang_dflash.bench.sweep import main

if __name__ == "__main__":
    sys.exit(main())
