"""One option schema for every command: a frozen dataclass whose fields are declared with ``opt``.

Each such field is at once a ``--dashed-name`` command-line option (``cli/options.py`` makes the
click option from it), a TOML key (dashes or underscores), an environment variable (click's
P2P_COCODC_<COMMAND>_<OPTION>) and a line of --help stating its default. Declared once, these cannot
drift apart, and a bad value from any of them is refused with the same one line naming the option.
Fields declared without ``opt`` are internal settings: no option, no key.
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from dataclasses import MISSING, Field, field, fields
from pathlib import Path
from typing import Any

from p2p_cocodc.errors import UserError

AUTO = "auto"
REQUIRED: Any = MISSING  # the default of an option that has none: it must be given
# click's own names for its types, so that every option of every command reads alike
METAVARS = {"int": "INTEGER", "float": "FLOAT", "str": "TEXT"}


def opt(
    default: Any,
    help: str,
    choices: tuple[str, ...] | None = None,
    auto: bool = False,
    computes: bool = True,
    shown: str | None = None,
    metavar: str | None = None,
    many: bool = False,
    flag: str | None = None,
    parse: Callable[[str], Any] | None = None,
) -> Any:
    """A field that is an option: its help text, allowed string values, whether it accepts 'auto',
    and whether it changes what a run computes or records (``computes``: False for output paths,
    checkpoint settings and thread count, which a resumed run may change). ``default`` REQUIRED:
    the option must be given. ``shown``: the default as --help states it, where the value itself says
    nothing (None: "none"); ``metavar``: what the option takes (FILE, DIR, HOST, I/N), where its type
    does not say; ``many``: a comma-separated list of ``choices``; ``flag``: the option's name where it
    is not the field's (``--wait-peers`` sets ``wait_peers_s``); ``parse``: turns the text given into
    the value, for a type no TOML or command-line value has (``--shard 0/3``)."""
    if shown is None and default is not REQUIRED:
        shown = "none" if default is None else str(default)
    metadata = {
        "help": help,
        "choices": choices,
        "auto": auto,
        "computes": computes,
        "shown": shown,
        "metavar": metavar,
        "many": many,
        "flag": flag,
        "parse": parse,
    }
    return field(default=default, metadata=metadata)


class Schema:
    """The options of one ``opt`` dataclass, by key: the option's name with underscores, which is
    click's name for it (so its environment variable) and its TOML key with underscores."""

    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.fields: dict[str, Field[Any]] = {}
        for f in fields(cls):
            if "help" in f.metadata:
                self.fields[(f.metadata["flag"] or f.name).replace("-", "_")] = f

    def flag(self, key: str) -> str:
        return "--" + key.replace("_", "-")

    def required(self, key: str) -> bool:
        return self.fields[key].default is REQUIRED

    def metavar(self, key: str) -> str:
        """What --help shows the option takes: its choices, its own metavar, else its type."""
        meta = self.fields[key].metadata
        if meta["choices"]:
            return "[" + "|".join(meta["choices"]) + "]" + (",..." if meta["many"] else "")
        if meta["metavar"]:
            return meta["metavar"]
        return METAVARS[_kind(self.fields[key])] + ("|auto" if meta["auto"] else "")

    def coerce(self, key: str, value: Any) -> Any:
        """Convert a TOML, environment or command-line value to the field's type, or say what is
        wrong with it."""
        f = self.fields[key]
        meta = f.metadata
        kind = _kind(f)
        option = self.flag(key)
        if value is None and "None" in str(f.type):
            return None
        if isinstance(value, str) and value == AUTO and meta["auto"]:
            return AUTO
        if meta["many"]:
            return _choose_many(option, value, meta["choices"])
        if meta["parse"] is not None:
            return meta["parse"](str(value))
        try:
            if kind == "bool":
                if isinstance(value, bool):
                    return value
                if str(value).lower() in ("true", "1", "yes", "on"):
                    return True
                if str(value).lower() in ("false", "0", "no", "off"):
                    return False
                raise ValueError
            if kind == "int":
                if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                    raise ValueError
                return int(value)
            if kind == "float":
                if isinstance(value, bool):
                    raise ValueError
                return float(value)
        except (TypeError, ValueError):
            expected = kind + (" or 'auto'" if meta["auto"] else "")
            raise UserError(f"{option} must be {expected}, got {value!r}") from None
        value = str(value)
        if meta["choices"] and value not in meta["choices"]:
            raise UserError(f"unknown {option} {value!r}: use one of {', '.join(meta['choices'])}")
        return value

    def given(self, values: dict[str, Any]) -> dict[str, Any]:
        """Values by key (click's names), coerced, by field name: what the class is built from."""
        return {self.fields[key].name: self.coerce(key, value) for key, value in values.items()}

    def read_table(self, table: dict[str, Any], where: str, skip: tuple[str, ...] = ()) -> dict[str, Any]:
        """A TOML table's values (keys with dashes or underscores), coerced, by field name; the
        sub-tables named in ``skip`` are left to their readers. ``where``: the table, for messages."""
        values = {}
        for key, value in table.items():
            if key in skip and isinstance(value, dict):
                continue
            name = key.replace("-", "_")
            if name not in self.fields:
                valid = ", ".join(self.flag(k)[2:] for k in self.fields)
                raise UserError(f"{where}: unknown key {key!r}; valid keys: {valid}")
            values[self.fields[name].name] = self.coerce(name, value)
        return values


def _kind(f: Field[Any]) -> str:
    """The field's type without its ``| None``: bool, int, float or str."""
    return str(f.type).split(" |")[0]


def _choose_many(option: str, value: Any, choices: tuple[str, ...]) -> str:
    """A comma list (or a TOML list) of ``choices``, each once, as one comma-separated string."""
    items = value if isinstance(value, list) else str(value).split(",")
    names = [str(item).strip() for item in items]
    for name in names:
        if name not in choices:
            raise UserError(f"unknown {option} {name!r}: use {' or '.join(choices)}, or a comma list of them")
    return ",".join(dict.fromkeys(names))


def read_toml(path: str | Path) -> dict[str, Any]:
    """A config file parsed, or UserError saying what is wrong with it."""
    try:
        return tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"--config {path}: no such file") from None
    except OSError as exc:
        raise UserError(f"--config {path}: cannot read it ({exc.strerror})") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"--config {path} is not valid TOML ({exc}): fix the file") from None
