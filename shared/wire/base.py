"""Base structs, one per casing used on the wire.

Wire values are immutable: reducers build new ones instead of editing shared ones. Every
subclass repeats `kw_only=True, frozen=True`, because msgspec does not inherit `kw_only`
and type checkers read each class alone; keyword-only fields let the seeds' order mix
optional and required fields.
"""

from __future__ import annotations

import msgspec

__all__ = ["CamelStruct", "SnakeStruct"]


class CamelStruct(msgspec.Struct, rename="camel", frozen=True):
    """Base for the diagnostics shapes (seeds 000 and 001) and rankscope's own events."""


class SnakeStruct(msgspec.Struct, frozen=True):
    """Base for shapes published in snake_case: Clarifai runners and ClusterD rank tables."""
