"""Codec names to classes, building a codec from a config's name and params or from a
spec string (``"int4:block_size=32"``), and looking a codec up by its wire id."""

from __future__ import annotations

import dataclasses
from typing import Any

from rackmend.codecs.base import Codec, CodecError, ParamValue
from rackmend.codecs.powersgd import PowerSGDCodec
from rackmend.codecs.quant import BF16Codec, IdentityCodec, Int4Codec, Int8Codec

__all__ = ["CODECS", "CODECS_BY_ID", "make_codec", "parse_codec_spec", "codec_by_id"]

CODECS: dict[str, type[Codec]] = {
    cls.name: cls for cls in (IdentityCodec, BF16Codec, Int8Codec, Int4Codec, PowerSGDCodec)
}
"""Every codec by name, in codec_id order."""

CODECS_BY_ID: dict[int, type[Codec]] = {cls.codec_id: cls for cls in CODECS.values()}
"""Every codec by its wire id (``Codec.codec_id``)."""


def make_codec(name: str, **params: Any) -> Codec:
    """``make_codec("int4", block_size=64)``, ``make_codec("powersgd", rank=4)``.

    Unknown names and parameters raise CodecError listing the valid choices; bad
    values raise CodecError from the codec's own checks.
    """
    cls = CODECS.get(name)
    if cls is None:
        raise CodecError(f"codec {name!r} is not known; use one of {', '.join(CODECS)}")
    allowed = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        takes = ", ".join(allowed) if allowed else "no parameters"
        raise CodecError(f"codec {name!r} does not take {', '.join(unknown)}; it takes {takes}")
    return cls(**params)


def _spec_value(text: str) -> ParamValue:
    """An int if ``text`` reads as one, else a float, else the string itself; the
    codec's own checks then refuse a value of the wrong type with a clear message."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            continue
    return text


def parse_codec_spec(text: str) -> Codec:
    """A codec from ``name[:key=value,...]``: ``"int4"``, ``"int4:block_size=32"``,
    ``"powersgd:rank=4"``. CodecError names the valid codecs or parameters."""
    if not isinstance(text, str):
        raise CodecError(f"codec spec must be a string like 'int4:block_size=32', got {type(text).__name__}")
    name, _, rest = text.strip().partition(":")
    params: dict[str, ParamValue] = {}
    for item in (part.strip() for part in rest.split(",")) if rest.strip() else ():
        key, eq, value = item.partition("=")
        if not eq or not key.strip() or not value.strip():
            raise CodecError(f"codec spec {text!r}: {item!r} is not key=value (e.g. 'int4:block_size=32')")
        if key.strip() in params:
            raise CodecError(f"codec spec {text!r} sets {key.strip()!r} twice")
        params[key.strip()] = _spec_value(value.strip())
    return make_codec(name.strip(), **params)


def codec_by_id(codec_id: Any) -> Codec:
    """A default instance of the codec with wire id ``codec_id``, for ``from_wire`` and
    ``decode`` (both read the parameters carried in the message, not the instance's)."""
    cls = CODECS_BY_ID.get(codec_id) if isinstance(codec_id, int) and not isinstance(codec_id, bool) else None
    if cls is None:
        known = ", ".join(f"{i} ({c.name})" for i, c in CODECS_BY_ID.items())
        raise CodecError(f"codec id {str(codec_id)[:20]} is not known; known ids are {known}")
    return cls()
