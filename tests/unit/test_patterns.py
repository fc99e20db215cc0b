"""Every validation pattern is anchored at the end, and client and server agree on text UTF-8 cannot
encode (issue 28).

Python's ``$`` matches before a trailing newline: with ``re.match`` (and pydantic's ``pattern=``),
metric key ``"loss\\n"``, event id ``"abc\\n"`` and project ``"projNL\\n"`` were accepted. Here every
check that applies one of ``instantml.limits``' patterns, in the client, the server and the CLI, is
given a valid value and the same value with a trailing newline.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import instantml as im
from instantml import limits, routes
from instantml.run import check_config, resolve_run_id
from shared.errors import DomainError, InvalidInput, check_path
from shared.events import RankEvent
from shared.ingest.bodies import RankEventBody, RunUpdateBody, ScalarEventBody
from shared.ingest.json_body import check_text_of, parse_json
from shared.ingest.parse import parse_batch, unquote_idempotency_key
from shared.runs import decode_cursor

#: A valid value of each pattern of ``instantml.limits``.
SAMPLES = {
    "NAME_PATTERN": "proj-1",
    "KEY_PATTERN": "train/loss",
    "EVENT_ID_PATTERN": "abc",
    "HOST_PATTERN": "gpu-node-07",
}


def accepts(check: Callable[[str], Any], value: str) -> bool:
    """Whether ``check`` takes ``value``: it neither returns False nor raises a ValueError (the
    client's ``LimitError``, pydantic's errors), a ``DomainError`` (the server's 400) or SystemExit
    (the CLI)."""
    try:
        result = check(value)
    except (ValueError, DomainError, SystemExit):
        return False
    return result is not False


def _rank_body(**fields: Any) -> Any:
    return RankEventBody.model_validate(event(**fields))


def _scalar_body(**fields: Any) -> Any:
    return ScalarEventBody.model_validate(scalar(**fields))


def event(**fields: Any) -> dict[str, Any]:
    return {"step": 1, "rank": 0, "world_size": 1, "metrics": {"a": 1.0}, **fields}


def scalar(**fields: Any) -> dict[str, Any]:
    return {"step": 1, "metrics": {"a": 1.0}, **fields}


def _cursor(run_id: str) -> Any:
    raw = json.dumps([1.0, run_id]).encode()
    return decode_cursor(base64.urlsafe_b64encode(raw).decode().rstrip("="))


def _batch_event_id(value: str) -> Any:
    body = json.dumps({"events": [event(event_id=value)]}).encode()
    return parse_batch("p", "r", body, 0.0, RankEvent)


def _cli_project(tmp_path: Path) -> Callable[[str], int]:
    from infra.cli import main

    return lambda value: main(["tokens", "--data-dir", str(tmp_path), "create", "--project", value])


#: (what, the pattern it applies, the check): each refuses by returning False or raising.
CHECKS: list[tuple[str, str, Callable[[str], Any]]] = [
    ("limits.is_valid_name", "NAME_PATTERN", limits.is_valid_name),
    ("limits.check_name", "NAME_PATTERN", lambda v: limits.check_name("project", v)),
    ("check_path project", "NAME_PATTERN", lambda v: check_path(v, None)),
    ("check_path run_id", "NAME_PATTERN", lambda v: check_path("p", v)),
    ("im.init run_id", "NAME_PATTERN", resolve_run_id),
    ("runs cursor run_id", "NAME_PATTERN", _cursor),
    ("im.init project", "NAME_PATTERN", lambda v: im.init(v, upload_mode="disabled")),
    ("limits.is_valid_key", "KEY_PATTERN", limits.is_valid_key),
    ("limits.check_metrics", "KEY_PATTERN", lambda v: limits.check_metrics({v: 1.0})),
    ("limits.check_rank_event", "KEY_PATTERN", lambda v: limits.check_rank_event({v: 1.0}, 1, 0, 1)),
    ("limits.check_scalars", "KEY_PATTERN", lambda v: limits.check_scalars({v: 1.0}, 1)),
    ("RankEventBody metrics", "KEY_PATTERN", lambda v: _rank_body(metrics={v: 1})),
    ("ScalarEventBody metrics", "KEY_PATTERN", lambda v: _scalar_body(metrics={v: 1})),
    ("limits.is_valid_event_id", "EVENT_ID_PATTERN", limits.is_valid_event_id),
    ("Idempotency-Key (quoted)", "EVENT_ID_PATTERN", lambda v: unquote_idempotency_key(f'"{v}"')),
    ("RankEventBody event_id", "EVENT_ID_PATTERN", lambda v: _rank_body(event_id=v)),
    ("ScalarEventBody event_id", "EVENT_ID_PATTERN", lambda v: _scalar_body(event_id=v)),
    ("batch event_id", "EVENT_ID_PATTERN", _batch_event_id),
    ("limits.is_valid_host", "HOST_PATTERN", limits.is_valid_host),
    ("RunUpdateBody hosts", "HOST_PATTERN", lambda v: RunUpdateBody.model_validate({"hosts": {"3": v}})),
]


def test_every_pattern_of_the_limits_has_a_sample_and_checks() -> None:
    patterns = {name for name in dir(limits) if name.endswith("_PATTERN")}
    assert patterns == set(SAMPLES), "a new pattern needs a sample here and its checks in CHECKS"
    assert {pattern for _, pattern, _ in CHECKS} == patterns
    for name, sample in SAMPLES.items():
        pattern = getattr(limits, name)
        assert re.fullmatch(pattern, sample)
        assert not re.fullmatch(pattern, sample + "\n")
        # As published (JSON Schema's dialect, where $ ends the input): anchored at both ends.
        assert pattern.startswith("^"), name
        assert pattern.endswith("$"), name


@pytest.mark.parametrize("suffix", ["\n", "\r\n", "\n\n"], ids=["LF", "CRLF", "LFLF"])
@pytest.mark.parametrize(("what", "pattern", "check"), CHECKS, ids=[what for what, _, _ in CHECKS])
def test_a_trailing_newline_is_refused(
    what: str, pattern: str, check: Callable[[str], Any], suffix: str
) -> None:
    sample = SAMPLES[pattern]
    assert accepts(check, sample), f"{what} refuses the valid {sample!r}"
    assert not accepts(check, sample + suffix), f"{what} accepts {sample + suffix!r}"


#: The length each pattern stops at: one number in ``instantml.limits``, the patterns built from it.
MAX_LENGTHS = {
    "NAME_PATTERN": limits.MAX_NAME_LENGTH,
    "KEY_PATTERN": limits.MAX_KEY_LENGTH,
    "EVENT_ID_PATTERN": limits.MAX_IDEMPOTENCY_KEY_LENGTH,
    "HOST_PATTERN": limits.MAX_HOST_LENGTH,
}


@pytest.mark.parametrize(("what", "pattern", "check"), CHECKS, ids=[what for what, _, _ in CHECKS])
def test_every_check_stops_at_its_limits_length(what: str, pattern: str, check: Callable[[str], Any]) -> None:
    longest = "a" * MAX_LENGTHS[pattern]
    assert accepts(check, longest), f"{what} refuses {len(longest)} characters"
    assert not accepts(check, longest + "a"), f"{what} accepts {len(longest) + 1} characters"


def test_the_servers_messages_for_a_bad_event_id_name_the_limits_length() -> None:
    rule = f"1-{limits.MAX_IDEMPOTENCY_KEY_LENGTH} printable ASCII characters"
    too_long = "a" * (limits.MAX_IDEMPOTENCY_KEY_LENGTH + 1)
    for refuse in (lambda: unquote_idempotency_key(too_long), lambda: _batch_event_id(too_long)):
        with pytest.raises(InvalidInput) as refused:
            refuse()
        assert rule in str(refused.value.details), refused.value.details
    with pytest.raises(ValueError, match=rule):
        _rank_body(event_id=too_long)


@pytest.mark.parametrize("route", [r for n, r in vars(routes).items() if n.isupper()])
def test_a_route_pattern_ends_at_the_end_of_the_path(route: str) -> None:
    """A route's pattern only cuts a path into segments (their names are checked afterwards): a path
    with a trailing newline is not that route's, and a segment keeps its newline for the check."""
    path = route.format(project="p", run_id="r")
    pattern = routes.path_pattern(route)
    assert pattern.match(path)
    found = pattern.match(path + "\n")
    if route.endswith("}"):  # the last segment keeps the newline, and check_path refuses it
        assert found is not None
        assert found.group(found.lastgroup or "") in ("p\n", "r\n")
    else:
        assert found is None


def test_the_tokens_command_refuses_a_project_with_a_trailing_newline(tmp_path: Path) -> None:
    create = _cli_project(tmp_path)
    with pytest.raises(SystemExit, match="project"):
        create("projNL\n")
    assert create("projNL") == 0


# ----------------------------------------------------------------------- text UTF-8 cannot encode


def test_client_and_server_agree_on_a_lone_surrogate_in_a_metric_key() -> None:
    key = "train/lo\udcffss"
    assert not limits.is_valid_key(key)
    run = im.init("p", run_id="r", upload_mode="disabled")
    with pytest.raises(ValueError, match=r"^metrics: key"):
        run.log_rank_metrics({key: 1.0}, step=0, rank=0, world_size=1)
    with pytest.raises(ValueError, match=r"^metrics: key"):
        run.log({key: 1.0})
    with pytest.raises(InvalidInput) as refused:
        parse_json(json.dumps(event(metrics={key: 1.0})))
    assert [d.field for d in refused.value.details] == ["metrics.train/lo\\udcffss"]


def test_the_client_converts_a_config_the_server_could_not_store() -> None:
    """A Trainer's output_dir decoded with surrogateescape: the README promises that values JSON cannot
    carry are converted, so the config is converted (its bytes shown as \\xNN), not refused."""
    config = check_config({"output_dir": "/out/caf\udce9", "k\ud800": ["\udcff", {"\udc80": "é"}]})
    assert config == {"output_dir": "/out/caf\\xe9", "k\\ud800": ["\\xff", {"\\x80": "é"}]}
    body = json.dumps({"config": config}).encode()
    assert RunUpdateBody.model_validate(parse_json(body)).config == config


@pytest.mark.parametrize(
    ("document", "fields"),
    [
        ({"config": {"p": "\udcff"}}, ["config.p"]),
        ({"config": {"a": {"b": [1, {"c\udcff": 1}]}}}, ["config.a.b.1.c\\udcff"]),
        ({"config": {"x": ["ok", "\ud800"]}, "y": "\udfff"}, ["config.x.1", "y"]),
        ({"\udcff": 1}, ["\\udcff"]),
        ("\udcff", ["body"]),
        ([["\udcff"] * 10], [f"0.{i}" for i in range(5)]),  # at most 5 named
    ],
)
def test_a_lone_surrogate_anywhere_in_a_body_is_refused_naming_it(document: Any, fields: list[str]) -> None:
    with pytest.raises(InvalidInput) as refused:
        check_text_of(document)
    assert [d.field for d in refused.value.details] == fields
    json.dumps(refused.value.error_object(), ensure_ascii=False).encode()  # the answer itself encodes
    encoded = json.dumps(document, ensure_ascii=False).encode("utf-8", "surrogatepass")  # raw ED xx xx
    for raw in (json.dumps(document).encode(), json.dumps(document), encoded):
        with pytest.raises(InvalidInput):
            parse_json(raw)


def test_a_surrogate_pair_is_not_a_lone_surrogate() -> None:
    assert parse_json(json.dumps({"config": {"emoji": "😀"}}).encode()) == {"config": {"emoji": "😀"}}
    assert limits.is_valid_key("loss 😀")


def test_time_is_bounded_by_the_one_definition() -> None:
    for model, body in ((RankEventBody, event), (ScalarEventBody, scalar)):
        assert model.model_validate(body(time=limits.MAX_TIME)).time == limits.MAX_TIME
        for bad in (limits.MAX_TIME * (1 + 1e-15), 1e300, -1.0):
            with pytest.raises(ValueError, match="time"):
                model.model_validate(body(time=bad))
    with pytest.raises(ValueError, match="time"):
        RunUpdateBody.model_validate({"status": "finished", "time": 1e300})
