"""What every command of the package shares on its command line."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and each option's default where it has one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False:  # "(default: None)" says nothing
            return action.help or ""
        if action.default == "":
            return f"{action.help} (default: empty)"
        return super()._get_help_string(action)


def parser(doc: str, prog: str | None = None) -> argparse.ArgumentParser:
    """An argument parser whose description is a module docstring."""
    return argparse.ArgumentParser(prog=prog, description=doc, formatter_class=HelpFormatter)


def comma_list(text: str) -> list[str]:
    """``"a, b,,c"`` -> ``["a", "b", "c"]``."""
    return [item.strip() for item in text.split(",") if item.strip()]
