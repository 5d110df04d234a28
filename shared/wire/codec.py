"""JSON encoding and decoding of wire shapes, with codecs built once per type."""

from __future__ import annotations

from typing import Any, TypeVar, overload

import msgspec

__all__ = ["WireError", "decode", "decoder", "encode"]

T = TypeVar("T")

_encoder = msgspec.json.Encoder()


class WireError(ValueError):
    """A payload that is not valid JSON or not the expected shape; the message names the
    JSON path of the first problem, e.g. ``Expected `int`, got `str` - at `$.priority```."""


def encode(obj: Any) -> bytes:
    """Encode a wire shape (or any msgspec-encodable value) as compact JSON."""
    return _encoder.encode(obj)


_decoders: dict[Any, msgspec.json.Decoder[Any]] = {}


def decoder(tp: Any) -> msgspec.json.Decoder[Any]:
    """The shared decoder for `tp` (a Struct, union or container type)."""
    found = _decoders.get(tp)
    if found is None:
        found = _decoders[tp] = msgspec.json.Decoder(tp)
    return found


@overload
def decode(data: bytes | str, tp: type[T]) -> T: ...
@overload
def decode(data: bytes | str, tp: Any) -> Any: ...  # unions: annotate the result
def decode(data: bytes | str, tp: Any) -> Any:
    """Decode `data` as `tp`, raising `WireError` that names the offending JSON path."""
    try:
        return decoder(tp).decode(data)
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
        raise WireError(str(exc)) from None
    except RecursionError:
        raise WireError("nested too deep to decode") from None
