"""Tensor codecs for outer gradients and updates, and error feedback.

Pure torch: each codec turns one float32 tensor into a few flat frames and back
(``none``, ``bf16``, block-wise ``int8``/``int4``, ``powersgd``), and
:class:`ErrorFeedback` carries what a lossy codec dropped into the next send. No
I/O and no wire format live here: the transport puts ``(codec, shape, params)`` in
its header, sends the frames' raw bytes, and on receipt calls ``Codec.from_wire``,
which checks every byte count before anything is decoded.
"""

from rackmend.codecs.base import Codec, CodecError, Encoded
from rackmend.codecs.feedback import ErrorFeedback, FeedbackEncoder
from rackmend.codecs.powersgd import PowerSGDCodec
from rackmend.codecs.quant import MAX_BLOCK_SIZE, BF16Codec, IdentityCodec, Int4Codec, Int8Codec
from rackmend.codecs.registry import CODECS, CODECS_BY_ID, codec_by_id, make_codec, parse_codec_spec

__all__ = [
    "Codec",
    "CodecError",
    "Encoded",
    "ErrorFeedback",
    "FeedbackEncoder",
    "IdentityCodec",
    "BF16Codec",
    "Int8Codec",
    "Int4Codec",
    "PowerSGDCodec",
    "MAX_BLOCK_SIZE",
    "CODECS",
    "CODECS_BY_ID",
    "make_codec",
    "parse_codec_spec",
    "codec_by_id",
]
