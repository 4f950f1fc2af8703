"""Allowed ranges of numeric settings, declared once on the config dataclasses' fields.

A settings dataclass declares a field's range in its metadata, in a short notation::

    lr: float = ranged(1e-5, "> 0")
    dropout: float = ranged(0.0, "[0, 1)")
    top_k: int = ranged(0, "int >= 0")
    max_grad_norm: float | None = ranged(1.0, "> 0 or null")

and calls :func:`check_field_ranges` in ``__post_init__`` (a value built in Python is refused there). The CLI's
checks (:mod:`rlhf_lit.checks`) read the same declarations from the parsed config before anything is built
(:func:`dataclass_ranges`), so a range is written once and both paths give the same message, naming the key.

Notation: ``[a, b]``, ``(a, b]``, ``[a, b)``, ``(a, b)`` intervals; ``> a``, ``>= a``, ``< b``, ``<= b``; a
leading ``int`` for whole numbers; ``or null`` (None allowed) and ``or <number>`` (one extra value, e.g.
``or -1``) at the end. Non-finite numbers and booleans are never in a range.

No imports from the rest of the package except :mod:`rlhf_lit.errors`: every layer may use this.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any, TypeVar

from rlhf_lit.errors import ConfigError

C = TypeVar("C")


def as_config(cls: type[C], value: C | dict | None) -> C | None:
    """Accept a settings dataclass or its dict form (as stored in a checkpoint's hparams); None stays None."""
    if value is None or isinstance(value, cls):
        return value
    if isinstance(value, dict):
        return cls(**value)
    raise TypeError(f"expected {cls.__name__} or a dict, got {type(value).__name__}")

__all__ = [
    "BETA",
    "LABEL_SMOOTHING",
    "Range",
    "as_config",
    "check_arguments",
    "check_field_ranges",
    "check_value",
    "dataclass_in",
    "dataclass_ranges",
    "option_type",
    "parse_range",
    "ranged",
]


@dataclass(frozen=True)
class Range:
    """An allowed range of a numeric setting: ``low``/``high`` bounds (open or closed), whole numbers only
    (``integer``), None allowed (``optional``), and single extra values allowed (``also``, e.g. -1)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    integer: bool = False
    optional: bool = False
    also: tuple = ()

    def describe(self, finite: bool = False) -> str:
        """E.g. ``a number in (0, 1]``, ``a whole number >= 1 (or null)``; ``finite`` writes ``a finite number``
        (the message for an inf or nan value, which ``inf > 0`` would not explain)."""
        number = "whole number" if self.integer else "number"
        kind = ("a finite " if finite else "a ") + number
        if self.low is not None and self.high is not None:
            text = f"{kind} in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"
        elif self.low is not None:
            text = f"{kind} {'>' if self.low_open else '>='} {self.low:g}"
        elif self.high is not None:
            text = f"{kind} {'<' if self.high_open else '<='} {self.high:g}"
        else:
            text = f"a finite {number}"
        extras = [repr(v) for v in self.also] + (["null"] if self.optional else [])
        return text + (f" (or {' or '.join(extras)})" if extras else "")

    def refusal(self, name: str, value: Any) -> str | None:
        """``"<name> must be <range>, got <value>"`` when ``value`` lies outside, else None: the one wording of
        every range check (settings, plain arguments, the CLI's checks)."""
        if self.allows(value):
            return None
        return f"{name} must be {self.describe(non_finite(value))}, got {value!r}"

    def allows(self, value: Any) -> bool:
        if value is None:
            return self.optional
        if value in self.also and not isinstance(value, bool):
            return True
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        if self.integer and value != int(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        if self.high is not None and (value >= self.high if self.high_open else value > self.high):
            return False
        return True


_INTERVAL = re.compile(r"^(?P<lo>[\[(])\s*(?P<a>[^,\s]+)\s*,\s*(?P<b>[^\])\s]+)\s*(?P<hi>[\])])$")
_BOUND = re.compile(r"^(?P<op>>=|<=|>|<)\s*(?P<v>\S+)$")


def parse_range(text: str) -> Range:
    """A :class:`Range` from the notation of the module docstring (``"int >= 1 or null"``).

    Raises:
        ValueError: if ``text`` is not in that notation (a programming error, not a user mistake).
    """
    spec = text.strip()
    integer = spec.startswith("int")
    if integer:
        spec = spec[3:].strip()
    optional, also = False, []
    parts = [p.strip() for p in spec.split(" or ")]
    spec, extras = parts[0], parts[1:]
    for extra in extras:
        if extra == "null":
            optional = True
        else:
            also.append(int(extra) if integer else float(extra))
    kw: dict[str, Any] = {}
    if match := _INTERVAL.match(spec):
        kw = dict(
            low=None if match["a"] == "-inf" else float(match["a"]),
            high=None if match["b"] == "inf" else float(match["b"]),
            low_open=match["lo"] == "(",
            high_open=match["hi"] == ")",
        )
    elif match := _BOUND.match(spec):
        op, value = match["op"], float(match["v"])
        kw = (
            dict(low=value, low_open=op == ">")
            if op.startswith(">")
            else dict(high=value, high_open=op == "<")
        )
    elif spec not in ("", "any"):
        raise ValueError(f"not a range: {text!r}")
    return Range(integer=integer, optional=optional, also=tuple(also), **kw)


#: The label-flip rate eps of label-smoothed Bradley-Terry losses (the reward model's ``label_smoothing``, DPO's
#: ``label_smoothing`` / ``robust``), one range for every place that checks it: at eps = 0.5 a label says
#: nothing (the loss is smallest at a zero margin whatever the pair), so 0.5 is outside.
LABEL_SMOOTHING = parse_range("[0, 0.5)")

#: DPO's (and its family's) ``beta``, the inverse temperature of the implicit reward ``beta * log(pi / pi_ref)``
#: (Rafailov et al. 2023, eq. 7), one range for every place that checks it: 0 would make every pair a tie.
BETA = parse_range("> 0")


def check_value(name: str, value: Any, allowed: Range) -> None:
    """Raise ``ValueError("<name> must be <allowed>, got <value>")`` unless ``allowed`` allows ``value`` (the check of a
    plain function argument; settings use :func:`check_field_ranges`, which raises ``ConfigError``)."""
    message = allowed.refusal(name, value)
    if message:
        raise ValueError(message)


def check_arguments(ranges: dict[str, Range], values: dict[str, Any], prefix: str = "") -> None:
    """Check plain constructor arguments against their declared ranges (a class's ``ARG_RANGES``, which the
    CLI's checks read too: ``checks.rules.model_ranges``).

    Raises:
        ConfigError: ``"<prefix><name> must be <range>, got <value>"`` for the first argument outside its range.
    """
    for name, allowed in ranges.items():
        if name in values and (message := allowed.refusal(prefix + name, values[name])):
            raise ConfigError(message)


def ranged(default: Any, allowed: str, **field_kwargs: Any) -> Any:
    """``dataclasses.field(default=default)`` with its allowed range (:func:`parse_range` notation) declared."""
    parse_range(allowed)  # a typo in a declaration fails at import, not when a user meets it
    metadata = {**field_kwargs.pop("metadata", {}), "range": allowed}
    return dataclasses.field(default=default, metadata=metadata, **field_kwargs)


def _field_range(field: dataclasses.Field) -> Range | None:
    text = field.metadata.get("range") if field.metadata else None
    return parse_range(text) if text else None


def non_finite(value: Any) -> bool:
    """True for a float inf or nan (its range message then says "a finite number")."""
    return isinstance(value, float) and not math.isfinite(value)


def option_type(kind: type, allowed: str):
    """An argparse ``type`` converting a command-line option to ``kind`` and refusing a value outside ``allowed``
    (this notation): ``argument --port: must be a whole number in [0, 65535], got 70000``.

    Raises (from the returned function):
        argparse.ArgumentTypeError: a value that does not convert, or lies outside the range.
    """
    rule = parse_range(allowed)

    def convert(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {rule.describe()}, got {text!r}") from None
        if not rule.allows(value):
            raise argparse.ArgumentTypeError(f"must be {rule.describe(non_finite(value))}, got {text}")
        return value

    return convert


def check_field_ranges(obj: Any, prefix: str = "") -> None:
    """Refuse a dataclass instance whose fields lie outside their declared ranges (call in ``__post_init__``).

    Raises:
        ConfigError: ``<prefix><field> must be <range>, got <value>`` for the first field out of range.
    """
    for field in dataclasses.fields(obj):
        rule = _field_range(field)
        message = rule and rule.refusal(f"{prefix}{field.name}", getattr(obj, field.name))
        if message:
            raise ConfigError(message)


def dataclass_in(hint: Any) -> type | None:
    """The dataclass in a type hint (``X``, ``X | None``, ``Optional[X]``), else None."""
    for arg in (hint, *getattr(hint, "__args__", ())):
        if isinstance(arg, type) and dataclasses.is_dataclass(arg):
            return arg
    return None


def dataclass_ranges(cls: type, prefix: str = "", _seen: tuple = ()) -> dict[str, Range]:
    """Every declared range of a dataclass, its nested dataclass fields included: ``{"lora.r": Range}``."""
    import typing

    if cls in _seen:
        return {}
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - an unresolvable annotation: only the fields' own metadata
        hints = {}
    found: dict[str, Range] = {}
    for field in dataclasses.fields(cls):
        rule = _field_range(field)
        if rule is not None:
            found[f"{prefix}{field.name}"] = rule
        nested = dataclass_in(hints.get(field.name))
        if nested is not None:
            found.update(dataclass_ranges(nested, f"{prefix}{field.name}.", (*_seen, cls)))
    return found
