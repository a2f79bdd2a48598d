"""Error feedback: carry what a lossy codec dropped into the next send.

For each key (say ``(fragment, tensor_index)``) the sender keeps a residual e and,
instead of x_t, encodes y_t = x_t + e_{t-1}, then keeps e_t = y_t - decode(encode(y_t)).
Summed over steps this telescopes:

    sum_t decoded_t = sum_t x_t - e_T

so the receiver's running total is never further from the true total than the
*current* residual, however many steps have passed. Without feedback the per-step
errors add up instead (a random walk that grows like sqrt(steps)). For block
quantisation the residual is bounded by a constant: with A = max |x| over steps in
a block, |e| <= A / (2 qmax - 1) (A/13 for int4, A/253 for int8), since each step's
error is half a block step and the step grows by at most the previous residual.
"""

from __future__ import annotations

import json
from typing import Any, Hashable, Mapping

import torch

from rackmend.codecs.base import Codec, CodecError, Encoded

__all__ = ["ErrorFeedback", "FeedbackEncoder", "FeedbackKey"]

FeedbackKey = Hashable
"""A residual's key: a str, an int, or a tuple of those (nested tuples allowed)."""


def _jsonable(key: Any) -> Any:
    if isinstance(key, str) or (isinstance(key, int) and not isinstance(key, bool)):
        return key
    if isinstance(key, tuple):
        return [_jsonable(k) for k in key]
    raise CodecError(
        f"error-feedback key {key!r} must be a str, an int or a tuple of those, "
        "so that state_dict() can name it with a string"
    )


def _key_to_str(key: FeedbackKey) -> str:
    return json.dumps(_jsonable(key), separators=(",", ":"))


def _key_from_json(value: Any) -> FeedbackKey:
    if isinstance(value, list):
        return tuple(_key_from_json(v) for v in value)
    if isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise CodecError(f"error-feedback state key holds {value!r}; expected str, int or lists of those")


class ErrorFeedback:
    """Residuals of lossy encodes, one per key, on the device of the tensors encoded.

    Keys are str, int, or tuples of those, because :meth:`state_dict` must name each
    residual with a string (JSON of the key, e.g. ``(3, 0)`` -> ``"[3,0]"``) so it
    can be saved with safetensors next to the rest of a checkpoint.
    """

    def __init__(self) -> None:
        self._residuals: dict[FeedbackKey, torch.Tensor] = {}

    def encode(self, key: FeedbackKey, x: torch.Tensor, codec: Codec, state: dict[str, Any] | None = None) -> Encoded:
        """Encode ``x`` plus the residual held for ``key`` and keep the new residual.

        Lossless codecs keep none: a residual left by an earlier lossy codec is
        added once (so nothing is lost when switching) and then dropped.
        """
        return self.encode_decoded(key, x, codec, state)[0]

    def encode_decoded(
        self, key: FeedbackKey, x: torch.Tensor, codec: Codec, state: dict[str, Any] | None = None
    ) -> tuple[Encoded, torch.Tensor]:
        """Like :meth:`encode`, and also return ``codec.decode(enc)``: exactly what a
        receiver reconstructs (bit for bit), so a sender that must apply the same
        value as its receivers uses this tensor, never ``y - residual``."""
        _jsonable(key)
        residual = self._residuals.get(key)
        if residual is not None:
            if residual.shape != x.shape or residual.device != x.device:
                raise CodecError(
                    f"error feedback for key {key!r} holds a residual of shape {tuple(residual.shape)} on "
                    f"{residual.device}, but x is {tuple(x.shape)} on {x.device}; call reset() after re-sharding"
                )
            y = x + residual
        else:
            y = x
        enc = codec.encode(y, state)
        decoded = codec.decode(enc)
        if codec.lossless:
            self._residuals.pop(key, None)
        else:
            self._residuals[key] = y - decoded
        return enc, decoded

    def residual(self, key: FeedbackKey) -> torch.Tensor | None:
        """The residual held for ``key`` (not a copy), or None."""
        return self._residuals.get(key)

    def __len__(self) -> int:
        return len(self._residuals)

    def reset(self) -> None:
        """Forget every residual (e.g. after the model or the fragment layout changed)."""
        self._residuals.clear()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """``{json_of_key: residual}``; the tensors are the live residuals, not copies
        (like ``nn.Module.state_dict``), ready for ``safetensors.torch.save_file``."""
        return {_key_to_str(k): v for k, v in self._residuals.items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Replace every residual with (copies of) those in ``state``."""
        loaded: dict[FeedbackKey, torch.Tensor] = {}
        for name, tensor in state.items():
            try:
                key = _key_from_json(json.loads(name))
            except (TypeError, json.JSONDecodeError):
                raise CodecError(f"error-feedback state key {name!r} is not a JSON-encoded key") from None
            if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.float32:
                raise CodecError(f"error-feedback residual {name!r} must be a float32 tensor")
            loaded[key] = tensor.detach().clone()
        self._residuals = loaded


class FeedbackEncoder:
    """One codec with error feedback and per-key codec state (PowerSGD's warm-start Q):
    what a sender of a stream of tensors keeps, learner (uplink) and syncer (downlink)
    alike. Keys as for :class:`ErrorFeedback`, e.g. ``(fragment, tensor_index)``."""

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self.feedback = ErrorFeedback()
        self.states: dict[FeedbackKey, dict[str, Any]] = {}

    def encode_decoded(self, key: FeedbackKey, x: torch.Tensor) -> tuple[Encoded, torch.Tensor]:
        """(encoded, decoded) of ``x`` plus the residual of ``key``; see ErrorFeedback."""
        return self.feedback.encode_decoded(key, x, self.codec, self.states.setdefault(key, {}))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Flat ``{name: tensor}`` (copies): ``residual/<key>`` and ``state/<key>/<field>``,
        so it fits a safetensors checkpoint as it is."""
        out = {f"residual/{k}": v.detach().clone() for k, v in self.feedback.state_dict().items()}
        for key, state in self.states.items():
            for field, value in state.items():
                if not isinstance(value, torch.Tensor):
                    raise CodecError(f"{self.codec.name}: codec state {field!r} of key {key!r} is not a tensor; "
                                     "only tensor state can be checkpointed")
                out[f"state/{_key_to_str(key)}/{field}"] = value.detach().clone()
        return out

    def load_state_dict(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Replace residuals and codec state with (copies of) those in ``tensors``."""
        residuals: dict[str, torch.Tensor] = {}
        states: dict[FeedbackKey, dict[str, Any]] = {}
        for name, value in tensors.items():
            kind, _, rest = name.partition("/")
            if kind == "residual":
                residuals[rest] = value
            elif kind == "state" and "/" in rest:
                key_text, _, field = rest.rpartition("/")
                try:
                    key = _key_from_json(json.loads(key_text))
                except (TypeError, json.JSONDecodeError):
                    raise CodecError(f"codec state name {name!r} does not hold a JSON-encoded key") from None
                states.setdefault(key, {})[field] = value.detach().clone()
            else:
                raise CodecError(f"compression state entry {name!r} is neither residual/<key> nor state/<key>/<field>")
        self.feedback.load_state_dict(residuals)
        self.states = states
