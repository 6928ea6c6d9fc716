"""Training DFlash drafts: ``python -m sglang_dflash.train --help``."""
