"""The ``fedpeft`` command's help, written for a terminal.

Command docstrings and option help are written like the rest of fedpeft's docstrings:
paragraphs wrapped at the source's line length, code in reStructuredText's double
backticks. typer's rich help keeps a docstring's line breaks in places (the commands
list, a command's later paragraphs) and prints the backticks. :class:`HelpGroup`, the
``fedpeft`` app's click group, shows every help text as plain paragraphs that rich wraps
to the terminal's width (:func:`plain`):

- a paragraph's lines are joined (paragraphs are separated by a blank line; one that
  starts with ``\\b`` is kept as written, click's convention);
- code in double or single backticks is quoted, ``'fedpeft run'``, or left bare if it is
  an option (``--nodes``: the help highlights options); a Sphinx role (``:mod:``, ...)
  leaves its target bare;
- the commands list shows each command's first sentence; its own ``--help``, all of it;
- an argument's help, which typer 0.20 under click 8.5 drops on the way to click (the
  argument shows its name only), is read back from the command's signature.

Only typer, click and the standard library: ``fedpeft --help`` imports nothing heavier.
"""

from __future__ import annotations

import inspect
import re

import click
from typer.core import TyperGroup

_ROLE = re.compile(r":(?:mod|func|class|meth|data|attr|obj):`~?([^`]+)`")
_LITERAL = re.compile(r"``(.+?)``|`([^`]+)`", re.S)
_SENTENCE_END = re.compile(r"(?<!e\.g\.)(?<!i\.e\.)(?<=[.!?])\s+(?=[A-Z(])")  # not after e.g./i.e.


def _literal(match: re.Match) -> str:
    code = " ".join((match.group(1) or match.group(2)).split())
    return code if code.startswith("-") else f"'{code}'"


def plain(text: str | None) -> str | None:
    """``text`` as terminal help: RST markup off, each paragraph on one line (rich wraps it)."""
    if not text:
        return text
    text = inspect.cleandoc(text).partition("\f")[0]
    text = _LITERAL.sub(_literal, _ROLE.sub(r"\1", text))
    paragraphs = re.split(r"\n[ \t]*\n", text.strip())
    return "\n\n".join(
        p if p.startswith("\b") else " ".join(line.strip() for line in p.splitlines()) for p in paragraphs
    )


def first_sentence(text: str) -> str:
    """The first sentence of ``text``'s first paragraph: a command's line in the list."""
    return _SENTENCE_END.split(text.split("\n\n")[0], maxsplit=1)[0]


def _argument_help(command: click.Command) -> dict[str, str]:
    """The help of ``command``'s arguments, as its function declares them."""
    from typer.models import ArgumentInfo
    from typer.utils import get_params_from_function

    function = getattr(command.callback, "__wrapped__", None)
    if function is None:
        return {}
    params = get_params_from_function(function)
    return {
        name: meta.default.help
        for name, meta in params.items()
        if isinstance(meta.default, ArgumentInfo) and meta.default.help
    }


def tidy(command: click.Command) -> None:
    """Make ``command``'s help (its own, its short help, its parameters') terminal help."""
    command.help = plain(command.help)
    if command.short_help:
        command.short_help = plain(command.short_help)
    elif command.help:
        command.short_help = first_sentence(command.help)
    lost = None
    for param in command.params:
        if isinstance(param, click.Argument) and getattr(param, "help", None) is None:
            lost = _argument_help(command) if lost is None else lost
            param.help = lost.get(param.name)
        if getattr(param, "help", None):
            param.help = plain(param.help)


class HelpGroup(TyperGroup):
    """A typer group whose help, and its commands', reads as plain, rewrapped paragraphs."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.help = plain(self.help)
        for param in self.params:
            param.help = plain(getattr(param, "help", None))
        for command in self.commands.values():
            tidy(command)
