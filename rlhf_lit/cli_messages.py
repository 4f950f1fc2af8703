"""jsonargparse's parse errors, condensed to one line that names the key, with a "did you mean".

jsonargparse reports a bad key or value under a subclass-mode argument (``model``, ``data``, a logger, a
dataclass option) as a tree: ``Parser key "model": / Does not validate against any of the Union subtypes /
Errors: / - Problem with given class_path '...PPOModule': / Parser key "kl": ... / Option 'kl_coeff' is not
accepted``, followed by a dump of the value. :func:`condense` walks that tree to its first real error (the
leaf), rebuilds the dotted key the user wrote (``model.init_args.kl.kl_coeff``), and for an unknown key
suggests the closest accepted name (from the class's signature, or the parser's options).

This module is the one place that reads jsonargparse's message text and argparse's private list of a
parser's actions (:func:`option_strings`): the layout was checked against jsonargparse 4.53 with Lightning
2.6.6 (Python 3.11's argparse), and ``tests/cli/test_cli_messages.py`` fails loudly if it changes.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import re
from typing import Any

__all__ = ["condense", "config_file_error", "config_files", "did_you_mean", "option_strings"]

_NOISE = (
    "Does not validate against any of the Union subtypes",
    "Subtypes:",
    "Errors:",
    "Given value type:",
    "Given value:",
    "Expected a <class 'NoneType'>",
    "Expected a <class 'bool'>",
    "Expected a <class 'collections.abc.Iterable'>",
    "Expected a path but",
    "Expected a dot import path string",
)
_PARSER_KEY = re.compile(r'^Parser key "(?P<key>[^"]+)":\s*(?P<rest>.*)$')
_CLASS_PATH = re.compile(r"^Problem with given class_path '(?P<path>[^']+)':\s*$")
_OPTION = re.compile(r"^Option '(?P<key>[^']+)' is not accepted$")
_GROUP_OPTION = re.compile(r"^Group '(?P<group>[^']+)' does not accept option '(?P<key>[^']+)'$")
_KEY_NOT_EXPECTED = re.compile(r'^Key "(?P<key>[^"]+)" is not expected$')
_SUBCOMMAND_OPTION = re.compile(
    r"^Subcommand '(?P<subcommand>[^']+)' does not accept option '(?P<key>[^']+)'$"
)
_UNRECOGNIZED = re.compile(r"^unrecognized arguments: (?P<args>.+)$")
_REQUIRED = re.compile(r"^the following arguments are required: (?P<keys>.+)$")
_EXPECTED = re.compile(r"^Expected an? (?P<type>.+?)\. Got value: (?P<value>.*)$")
_NO_ATTRIBUTE = re.compile(r"^module '(?P<module>[^']+)' has no attribute '(?P<name>[^']+)'$")
_NUMBER_EXPECTED = re.compile(r"^Expected an? <class '(int|float)'>$")  # a Union's first subtype error
_SUBTYPES = re.compile(r"^\s*Subtypes: \[(?P<types>.*)\]\s*$", re.MULTILINE)
_GIVEN_VALUE = re.compile(r"^\s*Given value: (?P<value>.*)$", re.MULTILINE)
# an optional choice (Literal[...] | None) given another word: the Union's first subtype error, no "Got value"
_OPTIONAL_CHOICE = re.compile(r"^Expected a typing\.Literal\[(?P<choices>.*)\]$")
_NON_FINITE = ("nan", "inf", "infinity")
# jsonargparse 4.53 hands a nested key's null (--model.init_args.backbone.tiny=null) to its type check as the
# text 'None': the outer value is NestedArg(key=..., val=None), the inner "Given value type: <class 'str'>"
_NESTED_NULL = re.compile(r"NestedArg\(key='[^']+', val=None\)")
_NULL_AS_TEXT = re.compile(r"Given value type: <class 'str'>\s*\n\s*Given value: None\s*$", re.MULTILINE)


def did_you_mean(name: str, candidates: list[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest candidate (a unique prefix match first), else ``""``."""
    candidates = sorted(set(candidates))
    prefixed = [c for c in candidates if c.startswith(name) and c != name]
    if len(prefixed) == 1:
        abbreviated = name.startswith("--")
        return f" (did you mean {prefixed[0]!r}?{' abbreviations are not accepted' if abbreviated else ''})"
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _import(path: str) -> Any:
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None


#: Constructor arguments that inject collaborators from Python (``PPOModule``'s ``sampler``, ``schedule`` and
#: ``refill_prompts``: tests and scripts): not options of a config or of the command line (``RLHFCLI``'s parser
#: skips them).
PYTHON_ONLY_ARGS = frozenset({"sampler", "schedule", "refill_prompts"})


def _accepted_names(cls: Any) -> list[str]:
    """The keys a class (or a dataclass) accepts: its ``__init__`` parameters, less :data:`PYTHON_ONLY_ARGS`."""
    if cls is None:
        return []
    if dataclasses.is_dataclass(cls):
        return [f.name for f in dataclasses.fields(cls) if f.init]
    try:
        params = inspect.signature(cls.__init__).parameters.values()
    except (TypeError, ValueError):
        return []
    skipped = {"self", *PYTHON_ONLY_ARGS}
    return [p.name for p in params if p.name not in skipped and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _field_type(cls: Any, name: str) -> Any:
    """The class behind option ``name`` of ``cls`` (through ``X | None``), for dotted unknown keys."""
    try:
        hints = inspect.get_annotations(cls if dataclasses.is_dataclass(cls) else cls.__init__, eval_str=True)
    except Exception:  # noqa: BLE001 - an unresolvable annotation just means no suggestion
        return None
    hint = hints.get(name)
    for arg in (*getattr(hint, "__args__", ()), hint):
        if (
            inspect.isclass(arg)
            and arg is not type(None)
            and (dataclasses.is_dataclass(arg) or _accepted_names(arg))
        ):
            return arg
    return None


def _every_key(prefix: str, cls: Any, depth: int = 4) -> list[str]:
    """Every dotted key under ``prefix`` that ``cls`` accepts, through its nested settings classes
    (``model.init_args.kl``, ``model.init_args.kl.kl_coef``, ...), ``depth`` levels down at most."""
    keys: list[str] = []
    for name in _accepted_names(cls):
        keys.append(f"{prefix}.{name}")
        nested = _field_type(cls, name) if depth > 1 else None
        if nested is not None:
            keys += _every_key(f"{prefix}.{name}", nested, depth - 1)
    return keys


def _similarity(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a, b).ratio()


def _elsewhere(name: str, here: str, section: str, root: tuple[str, Any] | None) -> str | None:
    """The full key, in another section of the root class, whose last part is closer to ``name`` than the
    section's own suggestion ``here`` ("" when it has none): ``--model.init_args.ppo.kl_coeff`` means
    ``model.init_args.kl.kl_coef``. None when the section's own suggestion is as close or closer."""
    if root is None or root[1] is None:
        return None
    scored = [
        (_similarity(name, key.rsplit(".", 1)[-1]), key)
        for key in _every_key(*root)
        if not key.startswith(f"{section}.") or key.count(".") != section.count(".") + 1
    ]
    best = max(scored, default=(0.0, ""), key=lambda pair: pair[0])  # of equals, the first in signature order
    if best[0] < 0.6 or best[0] <= (_similarity(name, here) if here else 0.0):
        return None
    return best[1]


def _unknown_key(path: str, key: str, cls: Any, options: list[str], root: tuple[str, Any] | None = None) -> str:
    """``unknown key model.init_args.kl.kl_coeff (did you mean 'kl_coef'?)``; the closest name in the key's
    own section, or the full key of a closer one in any other section of ``root`` (the dotted path and
    class of the model or data module): ``unknown key model.init_args.ppo.kl_coeff (did you mean
    'model.init_args.kl.kl_coef'?)``."""
    full = f"{path}.{key}" if path else key
    parts = key.split(".")
    if cls is not None:  # descend a dotted key through nested dataclasses to the part that is wrong
        section = path
        for i, part in enumerate(parts[:-1]):
            nested = _field_type(cls, part)
            if nested is None or part not in _accepted_names(cls):
                parts = parts[i:]
                break
            cls, section = nested, f"{section}.{part}"
        else:
            parts = parts[-1:]
        names = _accepted_names(cls)
        close = difflib.get_close_matches(parts[0], sorted(set(names)), n=1, cutoff=0.6)
        elsewhere = _elsewhere(parts[0], close[0] if close else "", section, root)
        hint = f" (did you mean {elsewhere!r}?)" if elsewhere else did_you_mean(parts[0], names)
    else:
        hint = did_you_mean(full, options)
    return f"unknown key {full}{hint}; 'rlhf-lit fit --print_config' lists every key"


def _leaf(message: str) -> tuple[list[tuple[str, str]], str] | None:
    """The first real error of a jsonargparse tree: ``(stack of (kind, value), text)``; when every line under
    the deepest key is noise, that key's stack and an empty text."""
    stack: list[tuple[int, str, str]] = []
    deepest: list[tuple[str, str]] = []
    # a type error listed as noise (a Union's bool subtype, say) is still the error when nothing else is
    fallback: tuple[list[tuple[str, str]], str] | None = None
    for raw in message.splitlines():
        if not raw.strip():
            continue
        indent = len(raw) - len(raw.lstrip(" -"))
        line = raw.strip().lstrip("- ").strip()
        while stack and stack[-1][0] >= indent:
            stack.pop()
        match = _PARSER_KEY.match(line)
        if match:
            stack.append((indent, "key", match["key"]))
            if len(stack) > len(deepest):
                deepest = [(k, v) for _, k, v in stack]
            if match["rest"] and not match["rest"].startswith(_NOISE):
                return [(k, v) for _, k, v in stack], match["rest"]
            continue
        match = _CLASS_PATH.match(line)
        if match:
            stack.append((indent, "class", match["path"]))
            continue
        if line.startswith(_NOISE):
            if fallback is None and _EXPECTED.match(line) and "NoneType" not in line:
                fallback = ([(k, v) for _, k, v in stack], line)
            continue
        return [(k, v) for _, k, v in stack], line
    if fallback is not None:
        return fallback
    return (deepest, "") if deepest else None


def _path(stack: list[tuple[str, str]]) -> tuple[str, Any, tuple[str, Any] | None]:
    """The dotted key of a stack (``init_args`` after a class that is not a dataclass), its last class, and
    its root: the dotted key and class of its first class that is not a dataclass (``model.init_args``,
    ``PPOModule``), whose every section a misplaced key is looked for in."""
    parts: list[str] = []
    cls = None
    root = None
    for kind, value in stack:
        if kind == "key":
            parts.append(value)
        else:
            cls = _import(value)
            if cls is not None and not dataclasses.is_dataclass(cls):
                parts.append("init_args")
                if root is None:
                    root = (".".join(parts), cls)
    return ".".join(parts), cls, root


def condense(message: str, options: list[str] | None = None) -> str:
    """One line for a jsonargparse error message: the key (as the user writes it), what is wrong, a fix.

    Args:
        message: ``str()`` of jsonargparse's ``ArgumentError`` (or of the ``ValueError`` it raises when a
            class fails to instantiate).
        options: the subcommand parser's option names (``--trainer.max_steps``, ...), for "did you mean"
            on unrecognized command-line arguments and unknown top-level keys.

    Returns:
        The condensed line; the message's first line if its layout is not recognised.
    """
    options = options or []
    if required := _REQUIRED.match(message.strip().splitlines()[0] if message.strip() else ""):
        keys = [k.strip().split(".", 1)[-1] for k in required["keys"].split(",")]
        return (
            f"no {' and no '.join(keys)} given: name them in a config, e.g. "
            f"rlhf-lit fit --config configs/sft/tiny.yaml (configs/<stage>/ holds one per stage)"
        )
    found = _leaf(message)
    if found is None:
        return message.strip().splitlines()[0] if message.strip() else "invalid arguments"
    stack, text = found
    path, cls, root = _path(stack)
    if _NESTED_NULL.search(message) and _NULL_AS_TEXT.search(message):
        section = path.rsplit(".", 1)[0]
        return (
            f"{path}=null: on the command line a nested key's null reaches the parser as the text 'None' "
            f"(jsonargparse); write {path.rsplit('.', 1)[-1]}: null in a --config file, or give the whole "
            f"section: --{section}='{{...}}'"
        )
    if not text:
        subtypes, given = _SUBTYPES.search(message), _GIVEN_VALUE.search(message)
        if len(stack) == 1 and subtypes and given:  # one key's Union, e.g. bool | None: name its types
            names = re.findall(r"<class '([^']+)'>", subtypes["types"])
            names = ["null" if n == "NoneType" else n.rsplit(".", 1)[-1] for n in names]
            return f"{path}: expected {' or '.join(names)}, got {given['value'].strip()!r}"
        return message.strip().splitlines()[0]
    if (choices := _OPTIONAL_CHOICE.match(text)) and (given := _GIVEN_VALUE.search(message)):
        union = [
            m["types"] for m in _SUBTYPES.finditer(message) if f"Literal[{choices['choices']}]" in m["types"]
        ]
        null = " or null" if union and "NoneType" in union[0] else ""
        return f"{path}: expected one of {choices['choices']}{null}, got {given['value'].strip()!r}"
    if text == "Expected a <class 'dict'>" and (given := _GIVEN_VALUE.search(message)):
        return f"{path}: expected a mapping ({{key: value, ...}}), got {given['value'].strip()!r}"
    keys = [o.lstrip("-") for o in options]
    if match := _UNRECOGNIZED.match(text):
        bad = [a.split("=", 1)[0] for a in match["args"].split() if a.startswith("-")]
        if bad:
            return f"unknown option {bad[0]}{did_you_mean(bad[0], options)}; 'rlhf-lit fit --help' lists every option"
        return f"unexpected argument {match['args'].split()[0]!r}; options are written --key=value"
    if match := _OPTION.match(text) or _KEY_NOT_EXPECTED.match(text):
        return _unknown_key(path, match["key"], cls, keys, root)
    if match := _SUBCOMMAND_OPTION.match(text):
        return _unknown_key(path, match["key"], None, keys)
    if match := _GROUP_OPTION.match(text):
        return _unknown_key(path, f"{match['group']}.{match['key']}", cls, keys, root)
    if match := _NO_ATTRIBUTE.match(text):
        module = _import_module(match["module"])
        names = [n for n in dir(module) if not n.startswith("_")] if module else []
        return (
            f"{path}.class_path: {match['module']}.{match['name']} does not exist"
            f"{did_you_mean(match['name'], names)}"
        )
    if (non_finite := _non_finite(message, text)) is not None:
        return _out_of_range(path, stack, non_finite)
    if match := _EXPECTED.match(text):
        expected = match["type"].replace("<class '", "").replace("'>", "").replace("typing.", "")
        if expected.startswith("Literal[") and expected.endswith("]"):
            expected = f"one of {expected[len('Literal[') : -1]}"
        return f"{path}: expected {expected}, got {match['value']!r}"
    where = f"{path}: " if path else ""
    return f"{where}{text}"


def _non_finite(message: str, text: str) -> str | None:
    """The value as given when a number key was given nan or inf (which jsonargparse reads as a string and
    refuses as "expected float"), else None."""
    match = _EXPECTED.match(text)
    if match is not None and match["type"] not in ("<class 'float'>", "<class 'int'>"):
        return None
    if match is None:
        if not _NUMBER_EXPECTED.match(text) or not (given := _GIVEN_VALUE.search(message)):
            return None
        match = given
    value = match["value"].strip().strip("'\"")
    return value if value.lower().lstrip("+-.") in _NON_FINITE else None


def _out_of_range(path: str, stack: list[tuple[str, str]], value: str) -> str:
    """``<key> must be <its declared range>, got nan``: the range as the checks state it
    (:func:`rlhf_lit.checks.rules.range_of`), or "a finite number" where none is declared."""
    from rlhf_lit.checks.rules import range_of

    section_class = next((_import(v) for k, v in stack if k == "class"), None)
    rule = range_of(path, section_class)
    described = "a finite number" if rule is None else rule.describe(finite=True)
    return f"{path} must be {described}, got {value}"


def _import_module(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def option_strings(parser, args) -> list[str]:
    """Option strings of the subcommand being parsed (for "did you mean"), else of the main parser (read from
    argparse's private ``_actions``, and a subcommand's parser from its action's ``choices``)."""
    names = [s for a in parser._actions for s in a.option_strings]
    argv = list(args or [])
    for action in parser._actions:
        choices = getattr(action, "choices", None)
        if isinstance(choices, dict) and argv and argv[0] in choices:
            names += [s for a in choices[argv[0]]._actions for s in a.option_strings]
    return names


def config_files(args: list[str] | None) -> list[str]:
    """The files given with ``--config FILE`` / ``--config=FILE`` on a command line."""
    argv = list(args or [])
    files = [value for flag, value in zip(argv, argv[1:]) if flag == "--config"]
    return files + [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]


def config_file_error(path: str) -> str | None:
    """What is wrong with a ``--config`` file that jsonargparse refused, naming the file: ``<file>: line L,
    column C: <what yaml found>`` for invalid YAML, ``<file>: the config file is empty ...`` for a file with no
    settings (jsonargparse says only ``Unexpected config:``), ``<file>: ... not a mapping`` for a top level that
    is a list or a scalar. None if it is a mapping of settings (or cannot be read: the parser says why).
    jsonargparse reports a YAML error without the file and the position (``Problems parsing config: while
    parsing a flow mapping``)."""
    import yaml

    try:
        with open(path, encoding="utf-8") as stream:
            loaded = yaml.safe_load(stream)
    except OSError:
        return None
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        what = "; ".join(str(p) for p in (err.context, err.problem) if p)
        return f"{path}: {where}invalid YAML: {what}"
    except yaml.YAMLError as err:
        return f"{path}: invalid YAML: {str(err).splitlines()[0]}"
    if loaded is None:
        return (
            f"{path}: the config file is empty (no settings, only blanks or comments); give a file with "
            "trainer:/model:/data: sections, e.g. one of configs/<stage>/*.yaml"
        )
    if not isinstance(loaded, dict):
        return (
            f"{path}: the config file holds a {type(loaded).__name__}, not a mapping of settings "
            "(trainer:/model:/data: sections)"
        )
    return None
