"""DFlash speculative decoding for SGLang, as a plugin (``--speculative-algorithm DFLASH``)."""

__version__ = "0.1.0"
