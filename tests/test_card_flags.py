"""The DFlash model cards' launch flags on the installed release (issue 78, item 5).

The rewrite itself is a pure function, tested against made-up parsers; the launches run SGLang's
real launcher and parser in a fresh interpreter (plugins load once per process) and stop right
after the parse, before any model is read.
"""

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest

from sglang_dflash import card_flags, compat, integration
from sglang_dflash.card_flags import CARD_COMMANDS, HOPPER_COMMANDS, RENAMED, CardFlagError, rewrite

RELEASE = compat.running()
OLD_NAMES = {"--mamba-scheduler-strategy", "--speculative-dflash-draft-window-size"}
MAPPED = RELEASE.has("card_flag_aliases_removed")


def release_without(*flags):
    """A parser's test: takes everything but ``flags``."""
    return lambda flag: flag not in flags


def test_card_names_a_release_lacks_take_its_names_with_one_line_each():
    argv = ["--model-path", "m", "--mamba-scheduler-strategy", "extra_buffer",
            "--speculative-dflash-draft-window-size=2048", "--tp-size", "1"]
    out, notes = rewrite(argv, release_without(*OLD_NAMES), "0.5.23")
    assert out == ["--model-path", "m", "--mamba-radix-cache-strategy", "extra_buffer",
                   "--speculative-draft-window-size=2048", "--tp-size", "1"]
    assert notes == [
        "sglang-dflash: --mamba-scheduler-strategy is --mamba-radix-cache-strategy on SGLang 0.5.23; using it",
        "sglang-dflash: --speculative-dflash-draft-window-size is --speculative-draft-window-size on SGLang "
        "0.5.23; using it",
    ]


def test_a_release_that_takes_the_card_name_keeps_it():
    argv = ["--mamba-scheduler-strategy", "extra_buffer", "--speculative-dflash-draft-window-size", "2048"]
    assert rewrite(argv, release_without(), "0.5.17") == (argv, [])


def test_everything_else_is_left_as_it_is():
    argv = ["--model-path", "--mamba-scheduler-strategy-like", "--no-such-flag", "x", "extra_buffer",
            "--mamba-radix-cache-strategy=no_buffer", "-h"]
    assert rewrite(argv, release_without(*OLD_NAMES, "--no-such-flag"), "0.5.23") == (argv, [])


def test_a_switch_that_became_a_setting_gets_its_value():
    argv = ["--enable-flashinfer-allreduce-fusion", "--tp-size", "2"]
    out, notes = rewrite(argv, release_without("--enable-flashinfer-allreduce-fusion"), "0.6.0")
    assert out == ["--flashinfer-allreduce-fusion-backend", "auto", "--tp-size", "2"]
    assert notes == ["sglang-dflash: --enable-flashinfer-allreduce-fusion is --flashinfer-allreduce-fusion-backend "
                     "auto on SGLang 0.6.0; using it"]


@pytest.mark.parametrize("argv, missing, words", [
    (["--mamba-scheduler-strategy", "extra_buffer"], ("--mamba-scheduler-strategy", "--mamba-radix-cache-strategy"),
     "--mamba-scheduler-strategy, from the DFlash model card, is not an option of SGLang 0.9.0 "
     "(nor --mamba-radix-cache-strategy): leave it out"),
    (["--cuda-graph-backend-prefill=tc_piecewise"], ("--cuda-graph-backend-prefill",),
     "--cuda-graph-backend-prefill, from the DFlash model card, is not an option of SGLang 0.9.0: leave it out"),
])
def test_a_card_flag_the_release_has_under_no_name_stops_in_one_line(argv, missing, words):
    with pytest.raises(CardFlagError) as e:
        rewrite(argv, release_without(*missing), "0.9.0")
    assert str(e.value.code) == "sglang-dflash: " + words and e.value.code != 0


def test_the_hook_rewrites_before_sglang_parses_and_logs_each_mapping(monkeypatch, caplog):
    monkeypatch.setattr(integration, "_release", lambda: compat.SGLangRelease("0.5.23"))
    monkeypatch.setattr(compat.SGLangRelease, "cli_options",
                        lambda self: frozenset({"--mamba-radix-cache-strategy", "--model-path"}))
    seen = []
    with caplog.at_level(logging.INFO, logger="sglang_dflash"):
        integration.card_flags_hook(seen.append, ["--model-path", "m", "--mamba-scheduler-strategy=extra_buffer"])
    assert seen == [["--model-path", "m", "--mamba-radix-cache-strategy=extra_buffer"]]
    assert caplog.messages == ["sglang-dflash: --mamba-scheduler-strategy is --mamba-radix-cache-strategy on "
                               "SGLang 0.5.23; using it"]
    seen.clear()
    integration.card_flags_hook(seen.append, ["--model-path", "m"])  # no card flag: the parser is not read
    assert seen == [["--model-path", "m"]]


def test_the_release_facts_match_the_installed_parser():
    options = RELEASE.cli_options()
    assert all((old in options) != MAPPED for old in OLD_NAMES)
    assert all(RENAMED[old][0] in options for old in OLD_NAMES)
    assert set(card_flags.CARD_FLAGS) - OLD_NAMES <= options  # every other card flag exists on 0.5.17-0.5.23
    removed = RELEASE.has("tc_piecewise_removed")
    assert RELEASE.cli_refuses("--cuda-graph-backend-prefill", "tc_piecewise") is removed
    for (flag, _), choice in card_flags.RETIRED_VALUES.items():
        assert RELEASE.cli_refuses(flag, choice) is False
    assert RELEASE.cli_refuses("--attention-backend", "no-such-backend") is True
    assert RELEASE.cli_refuses("--no-such-flag", "x") is False


ARGS = ("mamba_radix_cache_strategy", "speculative_draft_window_size", "speculative_dflash_block_size",
        "speculative_num_draft_tokens", "attention_backend", "speculative_draft_attention_backend",
        "cuda_graph_backend_prefill")
LAUNCH = f"""
    import json, runpy, sys
    from sglang.srt.server_args import ServerArgs

    def parsed(cls, raw):  # SGLang has parsed the command line: stop before any model is read
        print("PARSED " + json.dumps({{k: getattr(raw, k, None) for k in {ARGS!r}}}))
        raise SystemExit(0)

    ServerArgs.from_cli_args = classmethod(parsed)
    sys.argv = ["sglang.launch_server", *sys.argv[1:]]
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)  # as `python -m`
"""


def launch(argv, **env):
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(LAUNCH), "--model-path", "/models/target",
                          "--speculative-draft-model-path", "/models/draft", *argv],
                         capture_output=True, text=True, timeout=600,
                         env={**os.environ, "SGLANG_PLUGINS": "dflash", "HF_HUB_OFFLINE": "1", **env})
    lines = [line for line in out.stdout.splitlines() if line.startswith("PARSED ")]
    return out, json.loads(lines[0][len("PARSED "):]) if lines else None


def mapping_lines(stderr):
    return [line for line in stderr.splitlines() if "sglang-dflash: --" in line and "; using it" in line]


@pytest.mark.parametrize("card, impl", [("27b", "plugin"), ("4b", "plugin"), ("27b", "builtin")])
def test_the_cards_hopper_commands_parse_on_this_release(card, impl):
    out, args = launch([*HOPPER_COMMANDS[card], "--speculative-dflash-draft-window-size", "2048"],
                       SGLANG_DFLASH_IMPL=impl)
    assert out.returncode == 0 and args is not None, out.stderr[-3000:]
    assert args["mamba_radix_cache_strategy"] == "extra_buffer"
    assert args["speculative_draft_window_size"] == 2048
    assert args["attention_backend"] == "fa3"
    if card == "4b":
        assert args["speculative_dflash_block_size"] == 8 and args["speculative_draft_attention_backend"] == "fa3"
    else:
        assert args["speculative_num_draft_tokens"] == 16
    expected = [f"sglang-dflash: {old} is {RENAMED[old][0]} on SGLang {RELEASE.version}; using it"
                for old in ("--mamba-scheduler-strategy", "--speculative-dflash-draft-window-size")] if MAPPED else []
    assert [line[line.index("sglang-dflash"):] for line in mapping_lines(out.stderr)] == expected, out.stderr[-3000:]


def test_the_4b_cards_blackwell_command_parses_on_every_release():
    """The B200 line as published: trtllm_mha and fa4 parse everywhere (on Hopper the plugin then
    refuses them in one line, test_integration). 0.5.22 removed tc_piecewise, whose refusal SGLang
    prints after its whole usage: there the plugin takes breakable, the release's default, and says so."""
    out, args = launch(CARD_COMMANDS["4b"])
    assert "Traceback" not in out.stderr
    assert out.returncode == 0 and args is not None, out.stderr[-3000:]
    removed = RELEASE.has("tc_piecewise_removed")
    assert args["cuda_graph_backend_prefill"] == ("breakable" if removed else "tc_piecewise")
    said = [line[line.index("sglang-dflash"):] for line in out.stderr.splitlines() if "is not a choice" in line]
    assert said == ([f"sglang-dflash: --cuda-graph-backend-prefill tc_piecewise is not a choice on SGLang "
                     f"{RELEASE.version}; using breakable, what replaced it"] if removed else [])


@pytest.mark.parametrize("argv, expected", [
    (["--cuda-graph-backend-prefill", "tc_piecewise", "--tp-size", "1"],
     ["--cuda-graph-backend-prefill", "breakable", "--tp-size", "1"]),
    (["--cuda-graph-backend-prefill=tc_piecewise"], ["--cuda-graph-backend-prefill=breakable"]),
])
def test_a_card_value_the_release_refuses_becomes_what_replaced_it(argv, expected):
    refuses = lambda flag, value: (flag, value) == ("--cuda-graph-backend-prefill", "tc_piecewise")
    out, notes = rewrite(argv, release_without(), "0.5.23", refuses)
    assert out == expected
    assert notes == ["sglang-dflash: --cuda-graph-backend-prefill tc_piecewise is not a choice on SGLang 0.5.23; "
                     "using breakable, what replaced it"]
    assert rewrite(argv, release_without(), "0.5.17") == (argv, [])  # a release that takes it keeps it
    # The value alone, or after another flag, is not the card's.
    kept = ["--attention-backend", "tc_piecewise", "--cuda-graph-backend-prefill", "full"]
    assert rewrite(kept, release_without(), "0.5.23", lambda f, v: True) == (kept, [])


def test_a_flag_no_release_has_is_sglangs_one_error_line_without_a_traceback():
    out, args = launch([*HOPPER_COMMANDS["27b"], "--no-such-flag", "1"])
    assert out.returncode == 2 and args is None
    assert out.stderr.strip().splitlines()[-1].endswith("error: unrecognized arguments: --no-such-flag 1")
    assert "Traceback" not in out.stderr
