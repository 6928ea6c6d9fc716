"""The GPU lab's runbooks and readers (docs/gpu-lab.md). Not part of the installed package: import
them from a checkout's root (``python -m lab.lossless_pair``, ``import lab.plot_goals``)."""
