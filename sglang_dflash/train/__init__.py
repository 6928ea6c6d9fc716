"""Training DFlash drafts: ``sglang-dflash-train --help`` (or ``python -m sglang_dflash.train --help``)."""
