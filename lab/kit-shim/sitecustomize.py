"""Shim for running SGLang >= 0.5.23 from the GPU kit; lab/gpu-env.sh puts this folder on PYTHONPATH.

Every Qwen2/Qwen3/Llama MLP in 0.5.23 builds a DualGemm, which imports
sglang.kernels.ops.gemm.cutedsl_dual_gemm just to ask whether its fused kernel applies. That module
imports nvidia-cutlass-dsl (~95 MB of wheels, two more kit parts), and the kernel needs SM100, so
on Hopper the answer is always "no". Where cutlass is missing, this serves a stand-in module that
gives that answer with the same names; with cutlass installed it does nothing.
"""

import enum
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types

_DUAL_GEMM = "sglang.kernels.ops.gemm.cutedsl_dual_gemm"


class _DualGemmQuantMode(enum.IntEnum):  # mirrors the real enum's members and properties
    STATIC_PER_TENSOR = 0
    STATIC_PER_TOKEN = 1
    DYNAMIC_PER_TENSOR = 2
    DYNAMIC_PER_TOKEN = 3
    UNQUANT = 4

    @property
    def is_quantized(self):
        return self is not self.UNQUANT

    @property
    def is_dynamic(self):
        return self in (self.DYNAMIC_PER_TENSOR, self.DYNAMIC_PER_TOKEN)

    @property
    def is_per_token(self):
        return self in (self.STATIC_PER_TOKEN, self.DYNAMIC_PER_TOKEN)


class _NoCutlassDualGemm(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != _DUAL_GEMM or importlib.util.find_spec("cutlass") is not None:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.MAX_DUAL_GEMM_DECODE_TOKENS = 16
        module.DualGemmQuantMode = _DualGemmQuantMode
        module.can_use_dual_gemm = lambda *args, **kwargs: False


sys.meta_path.insert(0, _NoCutlassDualGemm())

# This file shadows any sitecustomize of the image: run that one too, looking past every shim of the
# chain (lab/ordered-penalizers records itself there too).
_chain = sys.modules.setdefault("_sitecustomize_chain", types.ModuleType("_sitecustomize_chain"))
_chain.seen = getattr(_chain, "seen", set()) | {os.path.dirname(os.path.abspath(__file__))}
_next = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") not in _chain.seen])
if _next is not None and _next.origin and os.path.isfile(_next.origin):
    _spec = importlib.util.spec_from_file_location("_image_sitecustomize", _next.origin)
    _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
