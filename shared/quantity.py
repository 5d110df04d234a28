"""Kubernetes quantity strings (`"1500Mi"`, `"3Gi"`, `"512M"`, `"4.5"`) as numbers."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

__all__ = ["parse_bytes", "parse_quantity"]

_SUFFIXES: dict[str, Decimal] = {
    "": Decimal(1),
    "m": Decimal("0.001"),
    "k": Decimal(10) ** 3,
    "K": Decimal(10) ** 3,
    "M": Decimal(10) ** 6,
    "G": Decimal(10) ** 9,
    "T": Decimal(10) ** 12,
    "P": Decimal(10) ** 15,
    "E": Decimal(10) ** 18,
    "Ki": Decimal(2) ** 10,
    "Mi": Decimal(2) ** 20,
    "Gi": Decimal(2) ** 30,
    "Ti": Decimal(2) ** 40,
    "Pi": Decimal(2) ** 50,
    "Ei": Decimal(2) ** 60,
}
_PATTERN = re.compile(
    r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE]([+-]?[0-9]+))?([a-zA-Z]{0,2})\s*$"
)


def parse_quantity(text: str) -> Decimal:
    """Parse a Kubernetes quantity into its exact value.

    Raises:
        ValueError: `text` is not a quantity; the message quotes it.
    """
    match = _PATTERN.match(text)
    if match is None or match.group(3) not in _SUFFIXES:
        raise ValueError(f"{text!r} is not a quantity (e.g. '1500Mi', '3Gi', '512M', '4.5')")
    number, exponent, suffix = match.groups()
    try:
        value = Decimal(number)
    except InvalidOperation:
        raise ValueError(f"{text!r} is not a quantity") from None
    if exponent:
        value *= Decimal(10) ** int(exponent)
    return value * _SUFFIXES[suffix]


def parse_bytes(text: str) -> int:
    """Parse a memory quantity into whole bytes, rounding a fraction up."""
    value = parse_quantity(text)
    whole = int(value)
    return whole + 1 if value > whole else whole
