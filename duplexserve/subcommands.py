"""Subcommands whose options, and the modules that define them, load only when chosen.

``duplexserve serve`` then imports nothing of the load generator or the benchmarks,
and ``duplexserve bench moshi-rtf`` on a GPU host imports no other benchmark's needs.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable, Sequence
from typing import Any, NoReturn


class LazyParser(argparse.ArgumentParser):
    """A subcommand's parser; ``define`` adds its options the first time it parses or shows help.
    An argument it does not know is refused with its own usage (the top-level parser's says
    nothing of the subcommand's options)."""

    def __init__(self, *args: Any, define: Callable[[argparse.ArgumentParser], None] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._define = define

    def _defined(self) -> None:
        define, self._define = self._define, None
        if define is not None:
            define(self)

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        self._defined()
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras

    def format_help(self) -> str:
        self._defined()
        if self.usage is None:  # every option spelt out is 100 lines for serve: the help lists them
            self.usage = self.short_usage()
        return super().format_help()

    def error(self, message: str) -> NoReturn:
        """The error first, in one line; a short usage after it only for an argument not known or
        missing (serve's full usage runs to 100 lines, above the line that matters)."""
        lines = f"{self.prog}: error: {message}\n"
        if not message.startswith("argument "):  # "argument --port: ...": a value, said in full
            lines += f"usage: {self.short_usage()}\n{self.prog} --help lists every option\n"
        self.exit(2, lines)

    def short_usage(self) -> str:
        """``PROG [POSITIONAL...] [options]``: the usage without the options spelt out."""
        parts = [self.prog]
        for action in self._get_positional_actions():
            name = action.metavar or action.dest
            if action.choices is not None and action.metavar is None:
                name = action.dest if action.dest != argparse.SUPPRESS else "COMMAND"
            parts.append(f"[{name}]" if action.nargs in ("?", "*") else str(name))
        return " ".join([*parts, "[options]"])


class DefaultsHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """argparse's ArgumentDefaultsHelpFormatter, without the defaults that say nothing: None
    (the help says what unset means), a switch's False and an empty text; the description
    and epilog as written (a legend keeps its lines)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if "%(default)" in text or not action.option_strings or default is argparse.SUPPRESS:
            return text
        if default is None or default is False or default == "":
            return text
        return f"{text} (default: %(default)s)"


def from_module(module: str, add: str = "add_arguments") -> Callable[[argparse.ArgumentParser], None]:
    """A ``define`` that imports ``module``, shows its docstring as the description and calls its ``add``."""

    def define(parser: argparse.ArgumentParser) -> None:
        loaded = importlib.import_module(module)
        parser.description = loaded.__doc__
        getattr(loaded, add)(parser)

    return define
