"""Lab only: the request-parameter matrix's reference server applies SGLang's penalizers in one order.

Plain decoding without the overlap scheduler (``--disable-overlap-schedule``, the matrix's exact
reference: its penalties see every token) applies each penalizer in place, in the iteration order of
the set of classes ``SamplingBatchInfo`` hands to ``BatchedPenalizerOrchestrator``. That order
follows the classes' addresses and changes from one process to the next, so with a repetition
penalty beside a frequency or presence penalty the reference's tokens change from run to run.
This puts the additive penalizers first and repetition last: the order of the penalties SGLang
accumulates for its overlap scheduler and every speculative worker (``update_penalties``), which
the plugin follows. ``lab/request_params_matrix.py`` puts this folder first on the reference
server's PYTHONPATH; the next ``sitecustomize`` on the path (the GPU kit's shim) still runs.
"""

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types

_ORCHESTRATOR = "sglang.srt.sampling.penaltylib.orchestrator"
_ORDER = ("BatchedFrequencyPenalizer", "BatchedPresencePenalizer", "BatchedMinNewTokensPenalizer",
          "BatchedRepetitionPenalizer")


def ordered(penalizers):
    rank = {name: i for i, name in enumerate(_ORDER)}
    return sorted(penalizers, key=lambda cls: (rank.get(cls.__name__, -1), cls.__name__))


def _patch(module) -> None:
    cls = module.BatchedPenalizerOrchestrator
    if getattr(cls, "_lab_ordered_penalizers", False):
        return
    init = cls.__init__

    def __init__(self, vocab_size, batch, penalizers, *args, **kwargs):
        init(self, vocab_size, batch, ordered(penalizers), *args, **kwargs)

    cls.__init__, cls._lab_ordered_penalizers = __init__, True


class _PatchOnImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Patches the orchestrator's module right after SGLang imports it (nothing is imported early)."""

    def find_spec(self, name, path=None, target=None):
        if name != _ORCHESTRATOR:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is not None and spec.loader is not self:
            self._loader, spec.loader = spec.loader, self
        return spec

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _patch(module)


sys.meta_path.insert(0, _PatchOnImport())

# Chain to the next sitecustomize on the path (the kit's shim, which chains on to the image's). Every
# shim of the chain records its folder in _sitecustomize_chain.seen and looks only past the folders
# seen, so none finds this file again (sys.path itself is left as it is).
_chain = sys.modules.setdefault("_sitecustomize_chain", types.ModuleType("_sitecustomize_chain"))
_chain.seen = getattr(_chain, "seen", set()) | {os.path.dirname(os.path.abspath(__file__))}
_next = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") not in _chain.seen])
if _next is not None and _next.origin and os.path.isfile(_next.origin):
    _spec = importlib.util.spec_from_file_location("_next_sitecustomize", _next.origin)
    _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
