"""Kubernetes quantities as the Runner specs carry them."""

from __future__ import annotations

from decimal import Decimal

import pytest

from rankscope.shared.quantity import parse_bytes, parse_quantity


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("3Gi", 3 * 2**30),
        ("1500Mi", 1500 * 2**20),
        ("512M", 512 * 10**6),
        ("1e3", 1000),
        ("0.5Ki", 512),
        ("2", 2),
        ("1.5G", 1_500_000_000),
    ],
)
def test_memory_quantities(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


def test_cpu_quantities_keep_fractions() -> None:
    assert parse_quantity("4.5") == Decimal("4.5")
    assert parse_quantity("100m") == Decimal("0.1")


def test_fractional_bytes_round_up() -> None:
    assert parse_bytes("1.0001K") == 1001


@pytest.mark.parametrize("text", ["", "Gi", "3GB", "-1Gi", "1..2", "three"])
def test_non_quantities_are_refused_quoting_the_input(text: str) -> None:
    with pytest.raises(ValueError, match="is not a quantity"):
        parse_quantity(text)
