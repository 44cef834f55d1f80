"""The command line and TOML files, read into `config.Config`.

Every field is set from the command line (`--section.field=value` or `--section.field value`)
or TOML files (`--config FILE.toml`, the same dotted keys as tables; several files are merged).
Precedence: command line > files > defaults. Parsing is tyro's (help from the attribute
docstrings in config.py); lists are comma-separated and booleans are true/false. An unknown key
is named with the nearest known one (`nearest_key`), every value is checked in `__post_init__`,
and a setting that this run would ignore is refused (scopes.py), all before any process
group exists, so a typo costs seconds instead of a queued multi-node job.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import io
import json
import re
import sys
import tomllib
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import tyro
from tyro.constructors import ConstructorRegistry, PrimitiveConstructorSpec, PrimitiveTypeInfo

import exitcodes
from config import NO_SIGNALS, Config, ConfigError
from scopes import check_given, ignored_here, replaced

KWARGS_KEYS = ("model.kwargs", "data.kwargs")  # JSON objects, or TOML tables in a file


def field_types() -> dict[str, Any]:
    """Every dotted key, `section.field`, in declaration order, with its annotated type."""
    types = {}
    for section in dataclasses.fields(Config):
        section_cls = typing.get_type_hints(Config)[section.name]
        hints = typing.get_type_hints(section_cls)
        for f in dataclasses.fields(section_cls):
            types[f"{section.name}.{f.name}"] = hints[f.name]
    return types


# ---------------------------------------------------------------------------------------------
# Parsing: tyro over config.py's dataclasses, with this project's spellings of values.


def _word(kind: type, what: str) -> Callable[[str], Any]:
    def parse(raw: str) -> Any:
        try:
            return kind(raw)
        except ValueError:
            raise ValueError(f"{raw!r} is not {what}") from None

    return parse


def _bool(raw: str) -> bool:
    lowered = raw.strip().lower()
    if lowered in ("true", "1", "yes", "on"):
        return True
    if lowered in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"{raw!r} is not true or false")


def _show(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


# The scalar types of the fields: how a value is read, and its help metavar.
_SCALARS: dict[type, tuple[Callable[[str], Any], str]] = {
    int: (_word(int, "an integer"), "INT"),
    float: (_word(float, "a number"), "FLOAT"),
    bool: (_bool, "{true,false}"),
}

_REGISTRY = ConstructorRegistry()


@_REGISTRY.primitive_rule
def _spellings(info: PrimitiveTypeInfo) -> PrimitiveConstructorSpec | None:
    """Booleans as true/false (also yes/no, on/off, 1/0), lists comma-separated (16,32,64), and
    every message naming the field, then the value."""
    if info.type in _SCALARS:
        parse, metavar = _SCALARS[info.type]
        return PrimitiveConstructorSpec(
            nargs=1,
            metavar=metavar,
            instance_from_str=lambda args: parse(args[0]),
            is_instance=lambda value: isinstance(value, info.type),
            str_from_instance=lambda value: [_show(value)],
        )
    if info.type_origin is Literal:  # named in the message as field, then value
        choices = typing.get_args(info.type)

        def choose(args: list[str]) -> str:
            if args[0] not in choices:
                raise ValueError(f"{args[0]!r} is not one of {', '.join(choices)}")
            return args[0]

        return PrimitiveConstructorSpec(
            nargs=1,
            metavar="{" + ",".join(choices) + "}",
            instance_from_str=choose,
            is_instance=lambda value: value in choices,
            str_from_instance=lambda value: [value],
        )
    if info.type_origin is tuple and typing.get_args(info.type)[1:] == (Ellipsis,):
        item = typing.get_args(info.type)[0]
        parse, metavar = _SCALARS.get(item, (str, "STR"))

        def parse_list(args: list[str]) -> tuple[Any, ...]:
            parts = [part.strip() for part in args[0].split(",")]
            if parts == [""]:
                return ()  # empty: each list field's doc says what that means, or refuses it
            if "" in parts:  # 16,,32 is a slip, not 16,32
                raise ValueError(f"{args[0]!r} has an empty element: remove the extra comma")
            try:
                return tuple(parse(part) for part in parts)
            except ValueError:
                expected = f"a comma-separated list ({metavar},...)"
                raise ValueError(f"{args[0]!r} is not {expected}") from None

        return PrimitiveConstructorSpec(
            nargs=1,
            metavar=f"{metavar},...",
            instance_from_str=parse_list,
            is_instance=lambda value: isinstance(value, tuple),
            str_from_instance=lambda value: [",".join(map(_show, value))],
        )
    return None


def load_toml(path: str | Path) -> dict[str, Any]:
    """A TOML file as dotted keys (`[train] epochs = 3` and `"train.epochs" = 3` alike). One
    key spelled both ways is refused: tomllib keeps both (the quoted key is one name with a
    dot in it), and which one was meant is not for the parser to guess. A bare dotted key and
    a table (`train.epochs = 3` and `[train]`) tomllib refuses itself."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            table = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {err}") from None
    except OSError as err:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {err}") from None

    def flatten(table: dict[str, Any], prefix: str) -> dict[str, Any]:
        flat: dict[str, Any] = {}
        for name, value in table.items():
            if isinstance(value, dict) and f"{prefix}{name}" not in KWARGS_KEYS:
                items = flatten(value, f"{prefix}{name}.")
            else:
                items = {f"{prefix}{name}": value}
            for key, item in items.items():
                if key in flat:
                    raise ConfigError(
                        f"config file {str(path)!r}: {key} is set twice (a quoted dotted key and "
                        "a table): keep one"
                    )
                flat[key] = item
        return flat

    return flatten(table, "")


def _toml_type_ok(annotation: Any, value: Any) -> bool:
    """A TOML value has the field's type (an integral float counts as an integer)."""
    if typing.get_origin(annotation) is tuple:
        item = typing.get_args(annotation)[0]
        return isinstance(value, list) and all(_toml_type_ok(item, v) for v in value)
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        integral = isinstance(value, float) and value.is_integer()
        return (isinstance(value, int) and not isinstance(value, bool)) or integral
    if annotation is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, str)  # str and Literal fields


def as_args(values: dict[str, Any], source: str) -> list[str]:
    """Dotted keys and TOML values as command-line arguments: the file goes through the same
    parser as the command line (the same suggestions for unknown keys, the same checks). A
    value of the wrong TOML type is refused here, naming the file, key and value."""
    annotations = field_types()

    def spell(value: Any) -> str:
        if isinstance(value, list):
            return ",".join(map(spell, value))
        if isinstance(value, float) and value.is_integer():
            return str(int(value))  # 3.0 for an integer field; a float field reads "3" alike
        return _show(value)

    args = []
    for key, value in values.items():
        if key in KWARGS_KEYS and isinstance(value, dict):
            value = json.dumps(value)  # a [model.kwargs] table
        if key in annotations and not _toml_type_ok(annotations[key], value):
            expected = _spelled_type(annotations[key])
            raise ConfigError(f"{source}: {key} = {value!r} is not {expected}")
        args.append(f"--{key}={spell(value)}")
    return args


def _spelled_type(annotation: Any) -> str:
    if typing.get_origin(annotation) is tuple:
        item = typing.get_args(annotation)[0]
        return "a list of " + {int: "integers", float: "numbers"}.get(item, "strings")
    if typing.get_origin(annotation) is Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(annotation)))
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    return names.get(annotation, str(annotation))


def split_config_flag(argv: list[str]) -> tuple[list[str], list[str]]:
    """Every `--config FILE` (or `--config=FILE`) out of argv, in order, and the rest."""
    rest: list[str] = []
    config_files: list[str] = []
    args = iter(argv)
    for arg in args:
        if arg != "--config" and not arg.startswith("--config="):
            rest.append(arg)
            continue
        path = next(args, None) if arg == "--config" else arg.removeprefix("--config=")
        if path is None:
            raise ConfigError("missing value for '--config': write --config=FILE.toml")
        if not path.strip():  # an unset variable; Path("") would be "." ("is a directory")
            raise ConfigError(f"--config: {path!r} (empty) names no file: write --config=FILE.toml")
        config_files.append(path)
    return config_files, rest


def nearest_key(key: str) -> str | None:
    """The known `section.field` key closest to `key`, or None when none is close.

    Section and field are scored apart (difflib's ratio, the lower of the two), so a
    misspelt section or field still finds its key while a shared section alone
    (optim.learning_rate, optim.min_lr_ratio) does not. tyro 1.0's own suggestion scores the
    whole `--key=value` token (`_backends/_tyro_help_formatting.py`, cutoff 0.8), so whether a
    typo got one depended on the length of its value."""
    wanted = key.lower()
    wanted_section, _, wanted_field = wanted.rpartition(".")

    def score(known: str) -> float:
        section, field_name = known.split(".")
        if not wanted_section:  # --epochs: a field without its section
            return difflib.SequenceMatcher(a=wanted_field, b=field_name).ratio()
        return min(
            difflib.SequenceMatcher(a=wanted_section, b=section).ratio(),
            difflib.SequenceMatcher(a=wanted_field, b=field_name).ratio(),
        )

    best = max(field_types(), key=score)
    if score(best) >= 0.6:  # difflib.get_close_matches' default cutoff
        return best
    # A right field in the wrong section ([data] lr = 0.1): the field alone decides.
    moved = [known for known in field_types() if known.split(".")[1] == wanted_field]
    return moved[0] if len(moved) == 1 else None


def _options(args: list[str]) -> list[tuple[str, str]]:
    """(key, value as typed) of each `--key=value` or `--key value` in `args`: every field
    takes exactly one value, so the word after a bare `--key` is its value.
    Keys as the dataclasses spell them (tyro also takes --data.batch-size). Unknown keys and
    stray words are refused, each with the nearest known key."""
    known = field_types()
    found = []
    words = iter(args)
    for word in words:
        if word in ("-h", "--help"):
            continue
        if not word.startswith("--"):
            name, _, value = word.partition("=")
            near = nearest_key(name)
            hint = f"; did you mean --{near}{'=' * bool(value)}{value}?" if near else ""
            raise ConfigError(f"unexpected argument {word!r}: options start with --{hint}")
        typed, has_value, value = word[2:].partition("=")
        key = typed.replace("-", "_")
        if key not in known:
            near = nearest_key(key)
            hint = f"; did you mean --{near}?" if near else ""
            raise ConfigError(f"unknown option {word}{hint} (--help lists every key)")
        if not has_value:
            following = next(words, None)
            if following is None or following.startswith("--"):  # the next option, no value
                raise ConfigError(f"missing value for {word}: write {word}=VALUE")
            value = following
        found.append((key, value))
    return found


def _file_args(config_files: list[str]) -> tuple[list[str], dict[str, str]]:
    """The config files' keys as command-line arguments, and the file that set each key.
    Several files are merged; a key set in two of them is refused, naming both (which one
    should win is not obvious from the command line). Unknown keys are named with the nearest
    known one."""
    known = field_types()
    args: list[str] = []
    origin: dict[str, str] = {}
    for path in config_files:
        source = f"config file {path!r}"
        values = load_toml(path)
        for key, value in values.items():
            if key not in known:
                near = nearest_key(key)
                hint = f"; did you mean {near}?" if near else " (--help lists every key)"
                raise ConfigError(f"{source}: unknown key {key} = {value!r}{hint}")
            if key in origin:
                raise ConfigError(
                    f"{key} is set in {origin[key]} and in {source}: set it in one file (or on "
                    "the command line, which beats both)"
                )
            origin[key] = source
        args += as_args(values, source)
    return args, origin


# Keys whose empty value the type allows but which is refused: `--run.preempt_signals=$SIGS`
# with the variable unset would turn the preemption checkpoint off without a word.
_NOT_EMPTY = {"run.preempt_signals": f"write {NO_SIGNALS} for no preemption checkpoint"}


def given_settings(argv: list[str]) -> dict[str, str]:
    """key -> value as typed, of every setting the command line or its --config files give."""
    return _given_and_origin(argv)[0]


def _given_and_origin(argv: list[str]) -> tuple[dict[str, str], dict[str, str]]:
    config_files, cli_args = split_config_flag(argv)
    file_args, origin = _file_args(config_files)
    cli = dict(_options(cli_args))
    given = dict(_options(file_args)) | cli
    return given, {key: source for key, source in origin.items() if key not in cli}


def notices(cfg: Config, argv: list[str], world_size: int, device_type: str) -> list[str]:
    """What train.py says at start about settings given and ignored (scopes.py): a file's
    setting another source's choice replaces, then those this process's placement ignores."""
    given, origin = _given_and_origin(argv)
    return [*replaced(cfg, given, origin), *ignored_here(given, world_size, device_type)]


def _check_not_empty(given: dict[str, str], origin: dict[str, str]) -> None:
    for key, fix in _NOT_EMPTY.items():
        value = given.get(key)
        if value is not None and not value.strip():
            where = f"{origin[key]}: " if key in origin else ""
            raise ConfigError(f"{where}{key}: '' (empty) is refused: {fix}")


def _plain(box: str) -> str:
    """tyro's error box as one line: its first section (the reason)."""
    sections: list[list[str]] = [[]]
    for line in box.splitlines()[1:]:  # the first line is the box's title
        text = line.strip().strip("│").strip()
        if text and set(text) <= set("─-"):
            sections.append([])
        elif text and not set(text) <= set("╰╯─"):
            sections[-1].append(text)
    parts = [" ".join(lines) for lines in sections if lines]
    if not parts:
        return box.strip()
    reason = re.sub(r"^Error parsing (--[\w.]+): ", r"\1: ", parts[0])  # the key, then the value
    return re.sub(r"^Error parsing [\w.]+: ", "", reason)  # a section's or Config's check


def _tyro(args: list[str], prog: str) -> Config:
    """tyro over Config with this project's spellings; its explanation of a refused value
    goes to stderr, and a ConfigError carries the reason on one line."""
    explained = io.StringIO()
    try:
        with contextlib.redirect_stderr(explained):
            return tyro.cli(
                Config,
                args=args,
                prog=prog,
                registry=_REGISTRY,
                use_underscores=True,  # --data.batch_size, as the fields are spelled
                config=(tyro.conf.FlagConversionOff,),  # --data.augment=false
            )
    except SystemExit as exit:
        if exit.code in (0, None):  # --help
            raise
        # One line, printed once by the caller: tyro's box said the same reason again above it.
        raise ConfigError(_plain(explained.getvalue())) from None


def parse_args(argv: list[str] | None = None, prog: str = "train.py") -> Config:
    """The command line (default sys.argv[1:]) over the --config files over the defaults, in
    one tyro pass (the files' keys first: a later key wins), then checked. Unknown keys are
    refused first, each with the nearest known key; then the values (tyro's explanation of a
    refused value goes to stderr); then settings this run would ignore. Every refusal is a
    ConfigError with the reason on one line, naming the config file when the key came from
    one. --help prints the help and exits 0."""
    argv = sys.argv[1:] if argv is None else list(argv)
    config_files, cli_args = split_config_flag(argv)
    if {"-h", "--help"} & set(cli_args):
        return _tyro(cli_args, prog)
    file_args, origin = _file_args(config_files)
    cli = dict(_options(cli_args))
    given = dict(_options(file_args)) | cli
    origin = {key: source for key, source in origin.items() if key not in cli}
    _check_not_empty(given, origin)
    try:
        cfg = _tyro([*file_args, *cli_args], prog)
    except ConfigError as err:
        named = set(re.findall(r"--([\w.]+)", str(err)))
        named |= set(re.findall(r"for ([a-z]+\.\w+):", str(err)))
        from_files = sorted({origin[key] for key in named & origin.keys()})
        if from_files:
            raise ConfigError(f"{', '.join(from_files)}: {err}") from None
        raise
    check_given(cfg, given, origin)
    return cfg


def parse_or_exit(argv: list[str] | None = None) -> Config:
    """`parse_args`, or exit 2 with the message: train.py's first step, before torch loads.

    Under torchrun a worker's 2 becomes torchrun's 1, which schedulers retry, so the launcher
    is told through its marker file (exitcodes.report_to_launcher) by every rank that meets
    the bad input: the first rank to fail ends the others (torchrun stops them), maybe before
    local rank 0 has parsed its command line."""
    try:
        return parse_args(argv)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        exitcodes.report_to_launcher(exitcodes.BAD_INPUT_MARKER, f"bad input: {err}")
        sys.exit(exitcodes.EXIT_BAD_INPUT)
