"""Codec names to classes, and building a codec from a config's name and params."""

from __future__ import annotations

import dataclasses
from typing import Any

from rackmend.codecs.base import Codec, CodecError
from rackmend.codecs.powersgd import PowerSGDCodec
from rackmend.codecs.quant import BF16Codec, IdentityCodec, Int4Codec, Int8Codec

__all__ = ["CODECS", "make_codec"]

CODECS: dict[str, type[Codec]] = {
    cls.name: cls for cls in (IdentityCodec, BF16Codec, Int8Codec, Int4Codec, PowerSGDCodec)
}
"""Every codec by name, in codec_id order."""


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
