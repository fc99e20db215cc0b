"""The stored events' digests: ``canonical_json`` writes exactly what the canonical JSON encoder writes.

A stored event's digest tells a retry (the same digest) from a reused id (another one), so its bytes
may never change: an event stored before a change must still match its own retry after it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from instantml import limits
from shared.ingest import bodies, parse

keys = st.text(st.characters(codec="utf-8", exclude_categories=("Cc", "Cs")), min_size=1, max_size=40).filter(
    limits.is_valid_key
)
values = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False),
    st.integers(-(2**53), 2**53),
    st.sampled_from(["NaN", "Infinity", "-Infinity"]),
)
maybe_float = st.one_of(st.none(), st.floats(0, limits.MAX_TIME), st.integers(0, 10**9))


@st.composite
def rank_bodies(draw: st.DrawFn) -> dict[str, Any]:
    world = draw(st.integers(1, limits.MAX_WORLD_SIZE))
    body: dict[str, Any] = {
        "step": draw(st.integers(0, limits.MAX_STEP)),
        "world_size": world,
        "rank": draw(st.integers(0, world - 1)),
        "metrics": draw(st.dictionaries(keys, values, min_size=1, max_size=8)),
    }
    for name, strategy in (
        ("local_rank", st.one_of(st.none(), st.integers(0, world - 1))),
        ("weight", st.one_of(st.floats(0, 1e12), st.integers(0, 10**6))),
        ("time", maybe_float),
        ("event_id", st.just("e-1")),
    ):
        if draw(st.booleans()):
            body[name] = draw(strategy)
    return body


def _reference(body: bodies.RankEventBody | bodies.ScalarEventBody, fields: tuple[str, ...]) -> str:
    return json.dumps({name: getattr(body, name) for name in fields}, sort_keys=True, separators=(",", ":"))


@pytest.mark.slow
@settings(max_examples=400, deadline=None)
@given(rank_bodies())
def test_a_rank_events_canonical_json_is_the_encoders(document: dict[str, Any]) -> None:
    body = bodies.validate_body(document)
    assert parse.canonical_json(body) == _reference(body, parse._DIGEST_FIELDS)


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(rank_bodies())
def test_a_scalar_events_canonical_json_is_the_encoders(document: dict[str, Any]) -> None:
    document = {k: v for k, v in document.items() if k in ("step", "metrics", "time", "event_id")}
    body = bodies.validate_scalar_body(document)
    fields = parse._SCALAR_DIGEST_FIELDS
    assert parse.canonical_json(body) == _reference(body, fields)


def test_the_digest_of_a_known_event_never_changes() -> None:
    """Pinned: events stored by earlier versions keep matching their retries."""
    body = bodies.validate_body(
        {
            "step": 7,
            "world_size": 8,
            "rank": 3,
            "local_rank": 3,
            "weight": 2,
            "time": 1.5,
            "metrics": {"z/ä": 1, 'a"b': -0.0, "loss": "NaN"},
        }
    )
    event = parse.to_event("p", "r", body, "e", 0.0)
    text = (
        '{"local_rank":3,"metrics":{"a\\"b":-0.0,"loss":"NaN","z/\\u00e4":1.0},"rank":3,"step":7,'
        '"time":1.5,"weight":2.0,"world_size":8}'
    )
    assert event.payload_digest == hashlib.blake2b(text.encode(), digest_size=16).digest()
