"""Payloads: a job's args, kwargs and options as the JSON stores keep, and back.

Payloads are stored as JSON. A value that plain JSON cannot hold but kombu's
JSON serializer can (``datetime``, ``date``, ``time``, ``Decimal``, ``UUID``,
``bytes``) is stored in kombu's own encoding (an object ``{"__type__": ...,
"__value__": ...}``), and :func:`decode_payload` turns it back into the value
before it is published: the worker gets exactly what plain Celery would have
sent. :func:`encode_payload` gives a payload's canonical JSON text and
:func:`storable_payload` its values as stored; both refuse a payload that
cannot be stored, or is over :data:`MAX_PAYLOAD_BYTES`, naming the culprit.

Not here: the record that holds a payload, and the record's own JSON form
(:func:`celery_exactonce.core.jobs.job_to_json`); free text such as reasons
(:func:`celery_exactonce.core.refs.sanitize_text`); the headers of a message
(:mod:`celery_exactonce.dispatch.messages`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from json.encoder import c_make_encoder as _c_encoder  # type: ignore[attr-defined]  # private
from json.encoder import encode_basestring_ascii
from typing import Any

from kombu.utils import json as kombu_json

from celery_exactonce.core import exceptions

#: Largest JSON payload (args, kwargs and options together) we store.
MAX_PAYLOAD_BYTES = 1024 * 1024


class _KombuEncoder(kombu_json.JSONEncoder):
    """kombu's JSON encoder, noting whether it met a value plain JSON cannot hold."""

    typed = False

    def default(self, o: Any) -> Any:
        self.typed = True
        return super().default(o)  # type: ignore[no-untyped-call]  # kombu is untyped


def _encode(value: Any) -> tuple[str, bool]:
    """Canonical JSON of ``value`` as kombu's serializer writes it; whether a value was typed."""
    encoder = _KombuEncoder(sort_keys=True, separators=(",", ":"), allow_nan=False)
    text = encoder.encode(value)
    if _TYPE_MARKER in text:  # a value kombu marks (or a look-alike): it must decode back
        try:
            kombu_json.loads(text)  # type: ignore[no-untyped-call]
        except Exception as exc:
            raise ValueError(
                f'an object with "__type__" and "__value__" keys that kombu cannot decode '
                f"(a worker could not read the message): {exc}"
            ) from exc
    return text, encoder.typed


_TYPE_MARKER = '"__type__"'


def _encode_payload(payload: Mapping[str, Any], context: str) -> tuple[str, bool]:
    try:
        text, typed = _encode(payload)
    except (TypeError, ValueError, OverflowError) as error:
        for field, value in payload.items():  # which field: the error names no culprit
            try:
                _encode(value)
            except (TypeError, ValueError, OverflowError) as exc:
                raise exceptions.InvalidPayload(
                    f"{context}: {field} cannot be stored as JSON: {exc}"
                ) from exc
        raise exceptions.InvalidPayload(f"{context}: cannot be stored as JSON: {error}") from error
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_PAYLOAD_BYTES:
        raise exceptions.InvalidPayload(
            f"{context}: payload is {size} bytes, over {MAX_PAYLOAD_BYTES}"
        )
    return text, typed


def encode_payload(payload: Mapping[str, Any], *, context: str) -> str:
    """Canonical JSON for a payload; raises :class:`InvalidPayload` naming the culprit.

    Values kombu's JSON serializer carries (``datetime``, ``Decimal``, ``UUID``,
    ``bytes``...) are written as kombu writes them; anything else plain JSON
    cannot hold (an arbitrary object, ``NaN``) is refused.
    """
    return _encode_payload(payload, context)[0]


#: Plain JSON as the stores write a payload's parts (ASCII-escaped, compact, no ``NaN``).
_PLAIN = json.JSONEncoder(separators=(",", ":"), allow_nan=False)
#: ``{"args":…,"kwargs":…,"options":…}`` around the three parts: what a payload's size adds.
_DOCUMENT_OVERHEAD = len('{"args":,"kwargs":,"options":}')


def plain_parts(args: Any, kwargs: Any, options: Any) -> tuple[str, str, str] | None:
    """The JSON texts of a payload's three parts, where every value is plain JSON.

    Each text is what the stores write for that part (:func:`storable_payload`
    leaves a plain payload as it is). ``None`` when the payload is not that
    simple: a value plain JSON cannot hold (kombu may type it), something
    that looks typed, ``NaN``, or a payload over :data:`MAX_PAYLOAD_BYTES`;
    :func:`storable_payload` then stores it, or refuses it naming the culprit.
    """
    try:
        if _c_encoder is None:  # no C accelerator: the encoder's own way
            texts = (_PLAIN.encode(args), _PLAIN.encode(kwargs), _PLAIN.encode(options))
        else:  # one C encoder for the three (``encode`` makes one per call), as _PLAIN's
            encode = _c_encoder(
                {}, _PLAIN.default, encode_basestring_ascii, None, ":", ",", False, False, False
            )
            join = "".join
            texts = (join(encode(args, 0)), join(encode(kwargs, 0)), join(encode(options, 0)))
    except (TypeError, ValueError, OverflowError):
        return None
    # ASCII-escaped: as many bytes as characters, and as many as the sorted document has.
    size = _DOCUMENT_OVERHEAD + len(texts[0]) + len(texts[1]) + len(texts[2])
    if size > MAX_PAYLOAD_BYTES or _TYPE_MARKER in texts[0] + texts[1] + texts[2]:
        return None
    return texts


def storable_payload(payload: Mapping[str, Any], *, context: str) -> dict[str, Any]:
    """``payload`` as it is stored: plain JSON values, kombu-typed ones in kombu's encoding.

    Raises :class:`InvalidPayload` naming the culprit if it cannot be stored. A
    payload of plain JSON values is returned as it is (no copy).
    """
    text, typed = _encode_payload(payload, context)
    if not typed:
        return dict(payload)
    return dict(json.loads(text))


def decode_payload(value: Any) -> Any:
    """A stored payload value with kombu's typed values decoded: what ``send_task`` gets.

    The inverse of :func:`storable_payload`; what a plain Celery worker would
    decode from the same JSON. A value with nothing to decode is returned as is.
    """
    if isinstance(value, dict):
        if value.keys() != _TYPE_KEYS and all(type(v) in _SCALARS for v in value.values()):
            return value  # the common case, a flat mapping: nothing can be typed inside
        decoded = {key: decode_payload(item) for key, item in value.items()}
        if decoded.keys() == _TYPE_KEYS:
            return kombu_json.object_hook(decoded)
        if all(decoded[key] is item for key, item in value.items()):
            return value
        return decoded
    if isinstance(value, (list, tuple)):
        if all(type(v) in _SCALARS for v in value):
            return value
        items = [decode_payload(item) for item in value]
        if all(new is old for new, old in zip(items, value, strict=True)):
            return value
        return items if isinstance(value, list) else tuple(items)
    return value


_TYPE_KEYS = frozenset({"__type__", "__value__"})
#: The JSON values kombu never types (a typed value is a mapping).
_SCALARS = frozenset({str, int, float, bool, type(None)})
