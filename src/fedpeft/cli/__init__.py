"""The ``fedpeft`` command: run, partition, methods, report, sweep; serve, join, certs (Flower).

One typer app made of three: the experiment commands (:mod:`fedpeft.cli.experiments`),
the deployment commands (:mod:`fedpeft.cli.deployment`) and those that say who may take
part in a deployment (:mod:`fedpeft.cli.security`), each added without a name, so that
every command is top-level: ``fedpeft serve``, not ``fedpeft deploy serve``.

Importing this package, ``fedpeft --help`` and a config's errors load no model library
(torch, transformers, flwr, ...): a command imports what it needs when it runs
(tests/cli/test_help.py checks it). Its help is plain, rewrapped text
(:mod:`fedpeft.cli.help`).
"""

from __future__ import annotations

import warnings
from typing import Annotated

import typer

from fedpeft.cli import deployment, experiments, security
from fedpeft.cli.common import quiet_libraries
from fedpeft.cli.help import HelpGroup

__all__ = ["app"]

HELP = """Federated, parameter-efficient fine-tuning of language models.

'fedpeft run CONFIG' runs an experiment (a YAML file; no CONFIG: the built-in one) and
'fedpeft report RUN...' compares finished runs; serve, superlink and join run one over
Flower. 'fedpeft COMMAND --help' tells more."""

# an error that escapes a command is one traceback, never a dump of every frame's locals
app = typer.Typer(
    cls=HelpGroup, add_completion=False, no_args_is_help=False, help=HELP, pretty_exceptions_show_locals=False
)
for commands in (experiments.app, deployment.app, security.app):  # in the order --help lists them
    app.add_typer(commands)
warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")


@app.callback()
def options(
    verbose: Annotated[
        bool,
        typer.Option("--verbose", "-v", help="Show other libraries' progress bars, logs and warnings too."),
    ] = False,
) -> None:
    """fedpeft: federated, parameter-efficient fine-tuning of language models."""
    if not verbose:
        quiet_libraries()
