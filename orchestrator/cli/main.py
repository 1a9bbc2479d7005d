"""`gpuprims-orchestrator`: start a node from apps.yaml, and talk to a running one.

The group loads a command's module only when that command runs (click's lazy-loading group
pattern), so each command pays for its own imports alone:

- ``status``, ``stop`` and ``set-gpu`` (`orchestrator.cli.control`) are control-socket clients:
  click, pyzmq and the control plane's messages; no node, no config schema, no front door, no numpy;
- ``start`` and ``validate`` (`orchestrator.cli.node`) read a config and run the node.

``--help`` lists every command with its one-line help, which loads all of them. `COMMANDS` is the
one table of what the CLI offers; docs/cli.md describes each command.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

import click

from gpuprims import __version__

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 110}

#: Command name -> ``module:attribute`` of its click command, imported when the command is used.
COMMANDS: dict[str, str] = {
    "start": "orchestrator.cli.node:start",
    "validate": "orchestrator.cli.node:validate",
    "status": "orchestrator.cli.control:status",
    "stop": "orchestrator.cli.control:stop",
    "set-gpu": "orchestrator.cli.control:set_gpu",
}


class LazyGroup(click.Group):
    """A click group whose subcommands are named up front and imported on first use."""

    def __init__(self, *args: Any, lazy_commands: Mapping[str, str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for name, target in lazy_commands.items():
            if target.count(":") != 1:
                raise ValueError(f"lazy command {name!r}: {target!r} is not 'module:attribute'")
        self.lazy_commands = dict(lazy_commands)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy_commands})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.lazy_commands:
            return self.load(cmd_name)
        return super().get_command(ctx, cmd_name)

    def load(self, cmd_name: str) -> click.Command:
        """Import the command ``cmd_name`` names; its module must define it as a click command."""
        module_name, attr = self.lazy_commands[cmd_name].split(":")
        cmd = getattr(importlib.import_module(module_name), attr, None)
        if not isinstance(cmd, click.Command):
            raise TypeError(f"lazy command {cmd_name!r}: {module_name}.{attr} is {type(cmd).__name__}, "
                            "not a click command")
        return cmd


@click.group(cls=LazyGroup, lazy_commands=COMMANDS, context_settings=CONTEXT)
@click.version_option(__version__, "--version", prog_name="gpuprims-orchestrator")
def main() -> None:
    """Run a gpuprims node and operate it."""


if __name__ == "__main__":
    main()
