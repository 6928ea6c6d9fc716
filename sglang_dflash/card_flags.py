"""The z-lab DFlash model cards' launch flags on the SGLang release that runs them.

The cards (Qwen3.5-4B/27B-DFlash, Qwen3.6-35B-A3B-DFlash) were written for an SGLang that still
took two names 0.5.20 dropped (both were deprecated aliases on 0.5.17-0.5.19). What each card flag
is on 0.5.17-0.5.23, read from the wheels' ``server_args.py`` and ``arg_groups/``:

=========================================  ===============================================================
card flag                                  0.5.17-0.5.23
=========================================  ===============================================================
``--mamba-scheduler-strategy``             alias of ``--mamba-radix-cache-strategy`` to 0.5.19; gone from
                                           0.5.20 (SGLang: "unrecognized arguments", exit 2): mapped here
``--speculative-dflash-draft-window-size`` alias of ``--speculative-draft-window-size`` to 0.5.19; gone
                                           from 0.5.20: mapped here
``--speculative-dflash-block-size``        exists (an alias of ``--speculative-num-draft-tokens``)
``--attention-backend trtllm_mha``,        parse on every release; Blackwell only: on Hopper the plugin
``--speculative-draft-attention-backend``  stops the start in one line (``config.BLACKWELL_ONLY_BACKENDS``)
``fa4``
``--linear-attn-{prefill,decode}-backend`` exist, ``flashinfer`` a choice; needs FlashInfer's GDN kernels
``flashinfer``                             (an H200 build without them failed for plain decoding too)
``--cuda-graph-backend-prefill``           ``tc_piecewise`` a choice to 0.5.21; 0.5.22 removed it (SGLang:
``tc_piecewise``                           "tc_piecewise was removed; select breakable, full, or disabled",
                                           after its whole usage): ``breakable``, the default, mapped here
``--enable-flashinfer-allreduce-fusion``   exists, deprecated for ``--flashinfer-allreduce-fusion-backend
                                           auto`` (mapped here once a release drops it)
``--cuda-graph-max-bs-decode``,            exist
``--max-running-requests``, ``--mem-
fraction-static``, ``--tp-size``
=========================================  ===============================================================

A card flag the running release lacks is rewritten to the release's name, with one log line, only
where the release lacks the card's name and has the other one, read from the release's own parser:
a release that takes the card's name again keeps it. A card flag the release lacks with no
replacement stops the start in one line. A card value the release's parser refuses
(``RETIRED_VALUES``) becomes the choice that replaced it, with one log line. Any other flag is
SGLang's: an unknown one gets argparse's usage and ``error: unrecognized arguments`` (exit 2), no
traceback, on 0.5.17 and 0.5.23.

Hopper (H100/H200) versions of the cards' commands on 0.5.23 (:data:`HOPPER_COMMANDS`): fa3 for
trtllm_mha and fa4, the linear-attention backends left at SGLang's default (triton), and no
``tc_piecewise`` (breakable prefill graphs are the CUDA default). The renamed flags may keep the
cards' names.

Only the launcher's command line is rewritten (``prepare_server_args``, which ``sglang serve`` and
``python -m sglang.launch_server`` both call): ``sgl.Engine(...)`` keyword arguments and ``--config``
files keep SGLang's names.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

PREFIX = "sglang-dflash: "

# Card flag -> what the release calls it: the flag, then any fixed value it needs.
RENAMED = {
    "--mamba-scheduler-strategy": ("--mamba-radix-cache-strategy",),
    "--speculative-dflash-draft-window-size": ("--speculative-draft-window-size",),
    # A switch that became a setting (deprecated on 0.5.17-0.5.23, so not mapped there yet).
    "--enable-flashinfer-allreduce-fusion": ("--flashinfer-allreduce-fusion-backend", "auto"),
}
# Card values a release may refuse -> the release's own choice that does what the card meant.
RETIRED_VALUES = {
    # 0.5.22 replaced torch.compile's piecewise prefill graphs by breakable ones, its CUDA default.
    ("--cuda-graph-backend-prefill", "tc_piecewise"): "breakable",
}
# Every flag the cards' SGLang commands use.
CARD_FLAGS = (
    "--speculative-algorithm", "--speculative-num-draft-tokens", "--speculative-dflash-block-size",
    "--speculative-draft-attention-backend", "--attention-backend", "--linear-attn-prefill-backend",
    "--linear-attn-decode-backend", "--mamba-scheduler-strategy", "--speculative-dflash-draft-window-size",
    "--max-running-requests", "--cuda-graph-max-bs-decode", "--cuda-graph-backend-prefill",
    "--enable-flashinfer-allreduce-fusion", "--mem-fraction-static", "--tp-size", "--trust-remote-code",
)

# The cards' commands (after the model paths), and their Hopper versions on 0.5.23.
CARD_COMMANDS = {
    "27b": ["--speculative-algorithm", "DFLASH", "--speculative-num-draft-tokens", "16", "--tp-size", "1",
            "--attention-backend", "fa3", "--mem-fraction-static", "0.75", "--mamba-scheduler-strategy",
            "extra_buffer", "--trust-remote-code"],
    "4b": ["--speculative-algorithm", "DFLASH", "--speculative-dflash-block-size", "8",
           "--speculative-draft-attention-backend", "fa4", "--attention-backend", "trtllm_mha",
           "--linear-attn-prefill-backend", "flashinfer", "--linear-attn-decode-backend", "flashinfer",
           "--mamba-scheduler-strategy", "extra_buffer", "--max-running-requests", "32",
           "--cuda-graph-max-bs-decode", "32", "--cuda-graph-backend-prefill", "tc_piecewise",
           "--enable-flashinfer-allreduce-fusion", "--mem-fraction-static", "0.8"],
}
HOPPER_COMMANDS = {
    "27b": CARD_COMMANDS["27b"],  # the 27B and 35B-A3B line runs on Hopper as it is
    "4b": ["--speculative-algorithm", "DFLASH", "--speculative-dflash-block-size", "8",
           "--speculative-draft-attention-backend", "fa3", "--attention-backend", "fa3",
           "--mamba-scheduler-strategy", "extra_buffer", "--max-running-requests", "32",
           "--cuda-graph-max-bs-decode", "32", "--enable-flashinfer-allreduce-fusion",
           "--mem-fraction-static", "0.8"],
}


class CardFlagError(SystemExit):
    """A card flag the running release has under no name: one line, a non-zero exit."""


def _flag_of(token: str) -> Optional[str]:
    if not token.startswith("--"):
        return None
    return token.split("=", 1)[0]


def rewrite(argv: Iterable[str], accepts: Callable[[str], bool], version: str,
            refuses: Callable[[str, str], bool] = lambda flag, value: False) -> tuple[list[str], list[str]]:
    """``argv`` with each card flag the release lacks under its name on this release, and each card
    value it no longer takes as the choice that replaced it.

    ``accepts(flag)`` says whether the release's parser takes ``flag``, ``refuses(flag, value)``
    whether it refuses that value. Returns the new argv and one log line per flag or value mapped.
    ``--flag value`` and ``--flag=value`` are both kept as spelled. Raises :class:`CardFlagError`
    for a card flag the release has under no name."""
    argv, notes = _retired_values(list(argv), refuses, version)
    out, seen = [], set()
    for token in argv:
        flag = _flag_of(token)
        if flag not in CARD_FLAGS or accepts(flag):
            out.append(token)
            continue
        other = RENAMED.get(flag)
        if other is None or not accepts(other[0]):
            also = f" (nor {other[0]})" if other else ""
            raise CardFlagError(f"{PREFIX}{flag}, from the DFlash model card, is not an option of SGLang "
                                f"{version}{also}: leave it out")
        value = token[len(flag):]  # "" or "=value"
        if len(other) > 1 and value:
            raise CardFlagError(f"{PREFIX}{flag} takes no value (it is {' '.join(other)} on SGLang {version})")
        out.extend([other[0] + value, *other[1:]])
        if flag not in seen:
            seen.add(flag)
            notes.append(f"{PREFIX}{flag} is {' '.join(other)} on SGLang {version}; using it")
    return out, notes


def _retired_values(argv: list[str], refuses: Callable[[str, str], bool], version: str) -> tuple[list[str], list[str]]:
    out, notes = [], []
    for i, token in enumerate(argv):
        flag, eq, value = token.partition("=")
        key = (flag, value) if eq else (argv[i - 1] if i else "", token)  # --flag=value, or --flag value
        if key in RETIRED_VALUES and refuses(*key):
            choice = RETIRED_VALUES[key]
            out.append(f"{flag}={choice}" if eq else choice)
            notes.append(f"{PREFIX}{key[0]} {key[1]} is not a choice on SGLang {version}; using {choice}, "
                         "what replaced it")
        else:
            out.append(token)
    return out, notes


def mentions_card_flag(argv: Iterable[str]) -> bool:
    """Whether any token names a card flag: only then is the release's parser read (~30 ms)."""
    return any(_flag_of(t) in CARD_FLAGS for t in argv)
