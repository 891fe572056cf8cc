"""The click options of a command, made from the option schema (``config/schema.py``).

Every option of an options class becomes one click option, defaulting to None so that a --config
file can fill what the command line leaves out; its help text and ``[default: …]`` come from the
schema, and click's ``auto_envvar_prefix`` gives it its environment variable. Values reach the
command as the text given: the schema coerces them, with the same message wherever they came from.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from p2p_cocodc.config.schema import Schema


class Option(click.Option):
    """click's option, but a default stated in words reads as it is written (click wraps it in
    parentheses), so that every default in --help reads ``[default: …]``."""

    def get_help_extra(self, ctx: click.Context) -> Any:
        extra = super().get_help_extra(ctx)
        if isinstance(self.show_default, str):
            extra["default"] = self.show_default
        return extra


def option(*names: str, **kwargs: Any) -> Callable[..., Any]:
    return click.option(*names, cls=Option, **kwargs)


def schema_options(
    schema: Schema, *, only: tuple[str, ...] | None = None, skip: tuple[str, ...] = ()
) -> Callable[..., Any]:
    """A decorator adding one option per field of ``schema``: ``only`` these keys in this order,
    or all but ``skip`` in the order the class declares them."""

    def add(command: Callable[..., Any]) -> Callable[..., Any]:
        keys = list(only) if only is not None else [k for k in schema.fields if k not in skip]
        for key in reversed(keys):
            command = _schema_option(schema, key)(command)
        return command

    return add


def _schema_option(schema: Schema, key: str) -> Callable[..., Any]:
    """One field of ``schema`` as a click option (a bool as ``--flag/--no-flag``)."""
    meta = schema.fields[key].metadata
    flag = schema.flag(key)
    shown = {"help": meta["help"], "show_default": meta["shown"]}
    if str(schema.fields[key].type).startswith("bool"):
        return option(f"{flag}/--no-{flag[2:]}", key, default=None, **shown)
    return option(flag, key, default=None, metavar=schema.metavar(key), **shown)


def config_option(help: str) -> Callable[..., Any]:
    """``--config FILE``, the TOML file the schema's keys may come from."""
    return option("--config", "config_path", type=click.Path(dir_okay=False), default=None, help=help)
