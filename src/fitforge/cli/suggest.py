"""A config's mistake (jsonargparse's error) as a :class:`~fitforge.exceptions.ConfigError`, with the nearest key."""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import re
import sys
from collections.abc import Iterable

from jsonargparse import ArgumentParser

from fitforge.exceptions import ConfigError

_UNKNOWN = re.compile(
    r"Option '([^']+)' is not accepted|does not accept option '([^']+)'|unrecognized arguments: --?([^\s=]+)",
    re.IGNORECASE,
)
_CLASS = re.compile(r"class_path[ =]'([^']+)'")
_SECTION = re.compile(r'Parser key "([^"]+)"')
_NO_MODULE = re.compile(r"No module named '([^']+)'")
_GIVEN = re.compile(r"(?:Given|Got) value: (.*?)(?:\. Got value:.*)?$", re.MULTILINE)
_EXPECTED = re.compile(r"Expected a (.+?)(?:\. Got value:.*)?\s*$", re.MULTILINE)
_LITERAL = re.compile(r"Literal\[([^\]]*)\]")
_TYPE = re.compile(r"<class '(?:[\w.]+\.)?(\w+)'>")
_CLASS_PROBLEM = re.compile(r"Problem with given class_path '([^']+)':\s*\n\s*(.+)")
_SUBCLASS = re.compile(r"(?:does not correspond to a subclass of|Not a valid subclass of) (\w+)")
_NO_ATTRIBUTE = re.compile(r"module '([\w.]+)' has no attribute '(\w+)'")


def config_error(error: Exception, parser: ArgumentParser, command: str, prefix: str = "") -> ConfigError:
    """``error`` told with the nearest valid key (``prefix``: where ``parser``'s keys sit, ``"data.args."``)."""
    who = f"fitforge {command}".rstrip()
    message = _SECTION.sub(lambda found: f'Parser key "{prefix}{found.group(1)}"', str(error).strip())
    unknown, missing = _UNKNOWN.search(message), _NO_MODULE.search(message)
    if missing is not None:
        return _not_importable(who, message, missing.group(1))
    problem = _CLASS_PROBLEM.search(message)
    inner = problem is not None and problem.group(2).lstrip().startswith("Parser key")  # one of its arguments
    if problem is not None and not inner and (unknown is None or not unknown.group(0).startswith("Option")):
        return _class_problem(who, message, *problem.groups())
    wrong = ConfigError(f"{who}: a wrong value in the config, nothing was built: {message}")
    if unknown is None:
        return _wrong_value(who, message) or wrong
    key = next(group for group in unknown.groups() if group)
    within = _CLASS.search(message)
    if within is not None:  # a key of a class's init_args: the class's parameters are the choices
        section = _SECTION.search(message)
        choices = parameters(within.group(1))
        if key in choices:  # a parameter it takes, given a value it does not (another branch said "not accepted")
            return _wrong_value(who, message[message.find(f'Parser key "{key}"') :], section) or wrong
        nearest = difflib.get_close_matches(key, choices, n=1, cutoff=0.6)
        return ConfigError(
            f"{who}: the config's key '{key}' of {within.group(1)}"
            f"{f' (under {section.group(1)!r})' if section else ''} is not accepted{_did_you_mean(nearest)}; "
            f"it takes: {', '.join(choices) or 'no arguments'}. Nothing was built"
        )
    keys = [name for name in _keys(parser) if name not in ("config", "print_config")]
    nearest = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
    parent = key.rpartition(".")[0]
    siblings = [name for name in keys if name.rpartition(".")[0] == parent] or [k for k in keys if "." not in k]
    return ConfigError(
        f"{who}: the config's key '{prefix}{key}' is not accepted{_did_you_mean(nearest, prefix)}; "
        f"expected one of: {', '.join(prefix + name for name in siblings)}. Nothing was built"
    )


def _not_importable(who: str, message: str, module: str) -> ConfigError:
    """One line for a ``class_path`` (or function) whose module does not import."""
    section, named = _SECTION.search(message), _CLASS.search(message)
    what = f"{named.group(1)!r}" if named else f"module {module!r}"
    under = f" (under {section.group(1)!r})" if section else ""
    top = module.split(".")[0]
    if named is not None and not named.group(1).startswith(top):  # its module imports one that is missing
        return ConfigError(
            f"{who}: cannot import {what}{under}: it imports {module!r}, which is not installed. Nothing was built"
        )
    here = os.getcwd() in sys.path or "" in sys.path
    return ConfigError(
        f"{who}: cannot import {what}{under}: no module named {module!r} "
        f"{f'in the current folder ({os.getcwd()}) or ' if here else ''}on sys.path; check the name, or run from "
        f"the folder that holds {top}.py (or add its folder to PYTHONPATH). Nothing was built"
    )


def _class_problem(who: str, message: str, class_path: str, reason: str) -> ConfigError:
    """One line for a ``class_path`` that imports but does not fit, with the nearest name of its module."""
    section = _SECTION.search(message)
    missing, nearest = _NO_ATTRIBUTE.search(reason), []
    if missing is not None:
        try:
            names = dir(importlib.import_module(missing.group(1)))
        except Exception:
            names = []
        nearest = [f"{missing.group(1)}.{name}" for name in difflib.get_close_matches(missing.group(2), names, n=1)]
    return ConfigError(
        f"{who}: the config's {section.group(1) if section else 'class_path'} = {class_path!r} does not fit: "
        f"{reason.strip().rstrip('.')}{_did_you_mean(nearest)}. Nothing was built"
    )


def _wrong_value(who: str, message: str, section: re.Match | None = None) -> ConfigError | None:
    """jsonargparse's account of a value no type of a key takes, told in one line (None where it is not
    one); ``section``: the key of the class whose argument it is, when ``message`` starts inside it."""
    keys = list(dict.fromkeys(([section.group(1)] if section else []) + _SECTION.findall(message)))
    if not keys:
        return None
    nested = ".init_args." if "init_args" in message or "class_path" in message or section else "."
    key = keys[0] + "".join(nested + inner for inner in keys[1:])
    start = message.rfind(f'Parser key "{keys[-1]}"')
    given = _GIVEN.search(message, max(start, 0))  # the deepest key's value
    if given is None:
        return None
    innermost = message[max(start, 0) : given.end()]  # what the deepest key expects
    literal = _LITERAL.search(innermost)
    choices = [choice.strip().strip("'\"") for choice in literal.group(1).split(",")] if literal else []
    takes = [f"one of {', '.join(choices[:8])}{', ...' if len(choices) > 8 else ''}"] if choices else []
    kinds = [kind.group(1) for kind in map(_TYPE.fullmatch, _EXPECTED.findall(innermost)) if kind is not None]
    takes += [f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}" for kind in kinds if kind != "NoneType"]
    takes += [f"the class_path of a {base} subclass" for base in dict.fromkeys(_SUBCLASS.findall(innermost))]
    if "Callable" in innermost or ("a class path" in innermost and not _SUBCLASS.search(innermost)):
        takes.append("an import path (a class or function)")
    takes += ["null"] if "NoneType" in kinds else []
    value = given.group(1).strip()
    nearest = difflib.get_close_matches(value, choices, n=1, cutoff=0.6)
    return ConfigError(
        f"{who}: the config's {key} = {value!r} is not valid{_did_you_mean(nearest)}; it takes "
        f"{' or '.join(dict.fromkeys(takes)) or 'another value'}. Nothing was built"
    )


def _did_you_mean(nearest: list[str], prefix: str = "") -> str:
    return f" (did you mean '{prefix}{nearest[0]}'?)" if nearest else ""


def _keys(parser: ArgumentParser) -> list[str]:
    """Every key a config may set in ``parser`` (dotted, as on the command line)."""
    keys = []
    for key in parser.get_defaults().keys():  # noqa: SIM118 - a Namespace is not iterable: keys() gives the dotted keys
        keys.append(key)
        if "." in key:  # its sections too (a misspelt "fitt:" is nearest to "fit")
            keys.extend(key.rsplit(".", depth)[0] for depth in range(1, key.count(".") + 1))
    return list(dict.fromkeys(keys))


def parameters(class_path: str) -> list[str]:
    """The names a class (or function) given by import path takes; [] when it does not import."""
    module, _, name = class_path.rpartition(".")
    try:
        target = getattr(__import__(module, fromlist=[name]), name)
        parameters: Iterable[inspect.Parameter] = inspect.signature(target).parameters.values()
    except (ImportError, AttributeError, TypeError, ValueError):
        return []
    return [p.name for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
