"""NATS for kiln: connecting, subject and stream names, and the JetStream streams.

Subjects (``prefix`` is ``settings.subject_prefix``):

- ``{prefix}.events.{category}.{stream_id}.{event_type}``: committed ledger events (stream
  ``{PREFIX}_EVENTS``, ``Nats-Msg-Id`` = event id).
- ``{prefix}.board.{compilation_id}.{idea|claim}.{candidate_id}``: the board
  (``{PREFIX}_BOARD``).
- ``{prefix}.work.experiments.{device_kind}.{tier}.{model_key}``: experiments waiting for an
  engine (work-queue stream ``{PREFIX}_WORK``; see :mod:`kiln.common.work`).
- ``{prefix}.traffic.{deployment_id}``: observed requests of one deployment (stream
  ``{PREFIX}_TRAFFIC``; :mod:`kiln.agent_runner.deployments.feed`).
- ``$KV.{prefix}_engines.>``: the engine pools' registry (key-value bucket ``{prefix}_engines``).

Each stream has one owner, the service that creates and updates it (:data:`STREAM_OWNERS`);
on a NATS with users (docs/design/security.md, "NATS") no other identity may.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any, Final, Literal

import nats
import structlog
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError

from kiln.common.errors import InvalidArgument, Unavailable
from kiln.common.nats_connect import NatsCredentials as NatsCredentials  # re-exported
from kiln.common.nats_connect import connect as connect
from kiln.common.nats_connect import inbox_prefix as inbox_prefix

log = structlog.get_logger(__name__)

# --- headers of an event message (the outbox writes them, consumers read them) --------------
MSG_ID: Final = "Nats-Msg-Id"
"""JetStream de-duplication header; on event messages it is the event id (a UUID)."""
H_POSITION: Final = "Kiln-Position"
"""The event's global ledger position (decimal)."""
H_STREAM_ID: Final = "Kiln-Stream-Id"
H_STREAM_VERSION: Final = "Kiln-Stream-Version"
H_EVENT_TYPE: Final = "Kiln-Event-Type"
H_SCHEMA_VERSION: Final = "Kiln-Schema-Version"
H_TEAM: Final = "Kiln-Team"
H_CORRELATION_ID: Final = "Kiln-Correlation-Id"
H_CAUSATION_ID: Final = "Kiln-Causation-Id"
H_RECORDED_AT: Final = "Kiln-Recorded-At"
"""When the ledger committed the event, ISO 8601 with UTC offset."""

BoardKind = Literal["idea", "claim"]
BOARD_KINDS: Final[tuple[BoardKind, ...]] = ("idea", "claim")

EVENTS_DUPLICATE_WINDOW_S: Final = 600.0
"""How long JetStream remembers ``Nats-Msg-Id`` values on the events stream, seconds."""
BOARD_DUPLICATE_WINDOW_S: Final = 120.0
"""How long JetStream remembers ``Nats-Msg-Id`` values on the board stream, seconds."""

_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
_STREAM_ID_RE = re.compile(r"^(?P<category>[a-z][a-z0-9_]{0,31})-[A-Za-z0-9_-]{1,128}$")
_CATEGORY_RE = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
_EVENT_TYPE_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,127}$")
_PREFIX_RE = re.compile(r"^[a-z][a-z0-9_]{0,31}$")


# --- names ----------------------------------------------------------------------------------
def _check_prefix(prefix: str) -> str:
    if not _PREFIX_RE.match(prefix):
        raise InvalidArgument(f"invalid subject prefix {prefix!r}: expected [a-z][a-z0-9_]{{0,31}}")
    return prefix


def check_id(what: str, value: str) -> str:
    """Return ``value`` if it is a valid id token (``[A-Za-z0-9_-]``, 1-128 chars), else
    InvalidArgument.
    """
    if not isinstance(value, str) or not _ID_RE.match(value):
        raise InvalidArgument(f"invalid {what} {value!r}: expected 1-128 chars of [A-Za-z0-9_-]")
    return value


def events_stream_name(prefix: str) -> str:
    """The JetStream stream holding published events, e.g. ``KILN_EVENTS``."""
    return _check_prefix(prefix).upper() + "_EVENTS"


def board_stream_name(prefix: str) -> str:
    """The JetStream stream holding the message board, e.g. ``KILN_BOARD``."""
    return _check_prefix(prefix).upper() + "_BOARD"


def work_stream_name(prefix: str) -> str:
    """The JetStream work-queue stream of experiments to run, e.g. ``KILN_WORK``."""
    return _check_prefix(prefix).upper() + "_WORK"


def traffic_stream_name(prefix: str) -> str:
    """The JetStream stream of observed traffic, e.g. ``KILN_TRAFFIC``."""
    return _check_prefix(prefix).upper() + "_TRAFFIC"


def traffic_subject(prefix: str, deployment_id: str) -> str:
    """``{prefix}.traffic.{deployment_id}``; InvalidArgument on a bad prefix or id."""
    return f"{_check_prefix(prefix)}.traffic.{check_id('deployment id', deployment_id)}"


WORK_TIERS: Final = ("fast", "full")
"""Engine tiers, the third token of a work subject after ``{prefix}.work.experiments``."""
_WORK_TOKEN_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")


def check_work_token(what: str, value: str) -> str:
    """Return ``value`` if it is a valid device kind or model key token
    (``[a-z0-9][a-z0-9_-]{0,63}``), else InvalidArgument.
    """
    if not isinstance(value, str) or not _WORK_TOKEN_RE.match(value):
        raise InvalidArgument(f"invalid {what} {value!r}: expected [a-z0-9][a-z0-9_-]{{0,63}}")
    return value


def _check_tier(tier: str) -> str:
    if tier not in WORK_TIERS:
        raise InvalidArgument(f"invalid tier {tier!r}: expected 'fast' or 'full'")
    return tier


def work_subject(prefix: str, device_kind: str, tier: str, model_key: str) -> str:
    """``{prefix}.work.experiments.{device_kind}.{tier}.{model_key}``.

    ``device_kind`` and ``model_key`` as :func:`kiln.common.work.device_kind` and
    :func:`kiln.common.work.model_key` make them; ``tier`` is "fast" or "full".

    Raises:
        InvalidArgument: a bad prefix, tier, device kind or model key.
    """
    kind = check_work_token("device kind", device_kind)
    key = check_work_token("model key", model_key)
    return f"{_check_prefix(prefix)}.work.experiments.{kind}.{_check_tier(tier)}.{key}"


def work_filter(prefix: str, device_kind: str = "*", tier: str = "*", model_key: str = "*") -> str:
    """Wildcard over work subjects: each token given or ``"*"``.

    For stream info, core subscriptions and single-consumer tools: a work-queue stream refuses
    consumers with overlapping filters, so pools consume exact subjects. Raises InvalidArgument
    on a bad prefix or token.
    """
    kind = device_kind if device_kind == "*" else check_work_token("device kind", device_kind)
    key = model_key if model_key == "*" else check_work_token("model key", model_key)
    tier = tier if tier == "*" else _check_tier(tier)
    return f"{_check_prefix(prefix)}.work.experiments.{kind}.{tier}.{key}"


def parse_work_subject(prefix: str, subject: str) -> tuple[str, str, str]:
    """Split a work subject into (device kind, tier, model key); InvalidArgument if it is not
    one.
    """
    parts = subject.split(".")
    if len(parts) != 6 or parts[0] != prefix or parts[1:3] != ["work", "experiments"]:
        raise InvalidArgument(f"not a work subject under {prefix!r}: {subject!r}")
    kind = check_work_token("device kind", parts[3])
    return kind, _check_tier(parts[4]), check_work_token("model key", parts[5])


def events_subject(prefix: str, stream_id: str, event_type: str) -> str:
    """``{prefix}.events.{category}.{stream_id}.{event_type}``, ``category`` being ``stream_id``
    up to its first ``-``. Raises InvalidArgument on a token that is not a valid subject token.
    """
    m = _STREAM_ID_RE.match(stream_id)
    if not m:
        raise InvalidArgument(f"invalid stream id {stream_id!r} for a subject")
    if not _EVENT_TYPE_RE.match(event_type):
        raise InvalidArgument(f"invalid event type {event_type!r} for a subject")
    return f"{_check_prefix(prefix)}.events.{m['category']}.{stream_id}.{event_type}"


def events_filter(
    prefix: str,
    *,
    category: str | None = None,
    stream_id: str | None = None,
    event_type: str | None = None,
) -> str:
    """Wildcard subject over events: ``{prefix}.events.>`` when nothing is given, else
    ``{prefix}.events.{category}.{stream_id}.{event_type}`` with ``*`` for each part not given
    (a ``stream_id`` implies its category).

    Raises:
        InvalidArgument: a bad category, stream id or event type, or a stream id outside
            ``category``.
    """
    base = f"{_check_prefix(prefix)}.events"
    if category is None and stream_id is None and event_type is None:
        return f"{base}.>"
    if category is not None and not _CATEGORY_RE.match(category):
        raise InvalidArgument(f"invalid category {category!r}: expected [a-z][a-z0-9_]{{0,31}}")
    if stream_id is not None:
        m = _STREAM_ID_RE.match(stream_id)
        if not m:
            raise InvalidArgument(
                f"invalid stream id {stream_id!r}: expected '<category>-<id>', id of [A-Za-z0-9_-]"
            )
        if category is not None and m["category"] != category:
            raise InvalidArgument(f"stream {stream_id!r} is not in category {category!r}")
        category = m["category"]
    if event_type is not None and not _EVENT_TYPE_RE.match(event_type):
        raise InvalidArgument(
            f"invalid event type {event_type!r}: expected [A-Za-z][A-Za-z0-9_]{{0,127}}"
        )
    return f"{base}.{category or '*'}.{stream_id or '*'}.{event_type or '*'}"


def _check_kind(kind: str) -> BoardKind:
    if kind not in BOARD_KINDS:
        raise InvalidArgument(f"invalid board kind {kind!r}: expected one of {BOARD_KINDS}")
    return kind


def board_subject(prefix: str, compilation_id: str, kind: str, candidate_id: str) -> str:
    """``{prefix}.board.{compilation_id}.{kind}.{candidate_id}``; InvalidArgument on a bad id or
    kind.
    """
    check_id("compilation id", compilation_id)
    check_id("candidate id", candidate_id)
    return f"{_check_prefix(prefix)}.board.{compilation_id}.{_check_kind(kind)}.{candidate_id}"


def board_filter(prefix: str, compilation_id: str, kind: str | None = None) -> str:
    """Wildcard subject of one compilation's board, or of one kind of post on it; InvalidArgument
    on a bad compilation id or kind.
    """
    check_id("compilation id", compilation_id)
    base = f"{_check_prefix(prefix)}.board.{compilation_id}"
    return f"{base}.>" if kind is None else f"{base}.{_check_kind(kind)}.*"


def parse_board_subject(prefix: str, subject: str) -> tuple[str, BoardKind, str]:
    """Split a board subject into (compilation id, kind, candidate id); InvalidArgument if it is
    not one.
    """
    parts = subject.split(".")
    if len(parts) != 5 or parts[0] != prefix or parts[1] != "board":
        raise InvalidArgument(f"not a board subject under {prefix!r}: {subject!r}")
    compilation_id = check_id("compilation id", parts[2])
    return compilation_id, _check_kind(parts[3]), check_id("candidate id", parts[4])


# --- streams --------------------------------------------------------------------------------
def _file_stream(
    name: str,
    description: str,
    subject: str,
    retention: RetentionPolicy,
    duplicate_window_s: float,
) -> StreamConfig:
    """A single-replica, file-backed stream that discards its oldest messages at its limits."""
    return StreamConfig(
        name=name,
        description=description,
        subjects=[subject],
        retention=retention,
        storage=StorageType.FILE,
        discard=DiscardPolicy.OLD,
        duplicate_window=duplicate_window_s,
        num_replicas=1,
    )


def events_stream_config(
    prefix: str, *, duplicate_window_s: float = EVENTS_DUPLICATE_WINDOW_S
) -> StreamConfig:
    """Config of the events stream: file storage, limits retention, kept forever."""
    return _file_stream(
        events_stream_name(prefix),
        "kiln ledger events, published through the outbox",
        events_filter(prefix),
        RetentionPolicy.LIMITS,
        duplicate_window_s,
    )


def board_stream_config(
    prefix: str, *, duplicate_window_s: float = BOARD_DUPLICATE_WINDOW_S
) -> StreamConfig:
    """Config of the board stream: file storage, limits retention, kept forever."""
    return _file_stream(
        board_stream_name(prefix),
        "kiln message board: ideas and claims per compilation",
        f"{_check_prefix(prefix)}.board.>",
        RetentionPolicy.LIMITS,
        duplicate_window_s,
    )


WORK_DUPLICATE_WINDOW_S: Final = 600.0
"""How long the work queue remembers ``Nats-Msg-Id`` (= experiment id), seconds."""


def work_stream_config(prefix: str) -> StreamConfig:
    """Config of the work queue: work-queue retention, file storage, de-duplicated by experiment
    id.
    """
    return _file_stream(
        work_stream_name(prefix),
        "kiln experiments waiting for an engine",
        f"{_check_prefix(prefix)}.work.>",
        RetentionPolicy.WORK_QUEUE,
        WORK_DUPLICATE_WINDOW_S,
    )


TRAFFIC_MAX_AGE_S: Final = 7 * 24 * 3600.0
"""How long observed traffic records stay in the traffic stream, seconds (a restarted
controller re-reads the records of its open windows from there)."""


def traffic_stream_config(prefix: str) -> StreamConfig:
    """Config of the traffic stream: file storage, limits retention, records kept a week."""
    config = _file_stream(
        traffic_stream_name(prefix),
        "kiln observed traffic: one subject per deployment",
        f"{_check_prefix(prefix)}.traffic.>",
        RetentionPolicy.LIMITS,
        EVENTS_DUPLICATE_WINDOW_S,
    )
    config.max_age = TRAFFIC_MAX_AGE_S
    return config


_STREAM_NAME_IN_USE = 10058  # JSStreamNameExistErr: same name, different config
_SUBJECTS_OVERLAP = 10065  # JSStreamSubjectOverlapErr


async def _ensure_stream(js: JetStreamContext, config: StreamConfig) -> None:
    try:
        await js.add_stream(config)
        return
    except BadRequestError as exc:
        # A concurrent creator may win between our check and create; older servers then report
        # overlapping subjects (10065) rather than the name in use (10058).
        if exc.err_code == _SUBJECTS_OVERLAP:
            try:
                await js.stream_info(str(config.name))
            except nats.js.errors.NotFoundError:
                raise exc from None
        elif exc.err_code != _STREAM_NAME_IN_USE:
            raise
    # The stream exists with another config: bring it to ours (idempotent, safe to race).
    await js.update_stream(config)
    log.info("nats.stream_updated", stream=config.name)


StreamKind = Literal["events", "board", "work", "traffic"]
STREAM_KINDS: Final[tuple[StreamKind, ...]] = ("events", "board", "work", "traffic")

STREAM_OWNERS: Final[dict[StreamKind, str]] = {
    "events": "ledger",  # the outbox publisher fills it
    "board": "agent-runner",  # its agents post and read the board
    "work": "agent-runner",  # it publishes the experiments engine pools take
    "traffic": "agent-runner",  # its deployments' traffic feed (ObserveTraffic) and controllers
}
"""The service that creates and updates each stream; the engine pool owns its registry bucket
(:func:`registry_bucket`). Nobody deletes a stream."""


def stream_name(prefix: str, kind: StreamKind) -> str:
    """The stream of ``kind`` under ``prefix``, e.g. ``KILN_WORK``."""
    names = {
        "events": events_stream_name,
        "board": board_stream_name,
        "work": work_stream_name,
        "traffic": traffic_stream_name,
    }
    return names[kind](prefix)


def registry_bucket(prefix: str) -> str:
    """The engine pools' key-value bucket, e.g. ``kiln_engines`` (stream ``KV_kiln_engines``,
    subjects ``$KV.kiln_engines.>``)."""
    return f"{_check_prefix(prefix)}_engines"


def owned_streams(service: str, *, open_server: bool) -> tuple[StreamKind, ...]:
    """The streams ``service`` declares when it starts: those :data:`STREAM_OWNERS` gives it, or
    all of them on an ``open_server`` (no users: any client may create streams there, so a
    service that starts first finds every stream, as before NATS had users)."""
    if open_server:
        return STREAM_KINDS
    return tuple(kind for kind in STREAM_KINDS if STREAM_OWNERS[kind] == service)


async def ensure_streams(
    js: JetStreamContext,
    prefix: str,
    kinds: tuple[StreamKind, ...] = STREAM_KINDS,
    *,
    events_duplicate_window_s: float = EVENTS_DUPLICATE_WINDOW_S,
    board_duplicate_window_s: float = BOARD_DUPLICATE_WINDOW_S,
) -> None:
    """Create or update (to this config) the streams of ``kinds`` (default: events, board and
    work queue); idempotent and safe to run concurrently.

    Raises:
        nats.js.errors.APIError: the server refused.
        nats.errors.TimeoutError: JetStream did not answer (also what a user without the
            permission to create the stream sees).
    """
    configs = {
        "events": lambda: events_stream_config(
            prefix, duplicate_window_s=events_duplicate_window_s
        ),
        "board": lambda: board_stream_config(prefix, duplicate_window_s=board_duplicate_window_s),
        "work": lambda: work_stream_config(prefix),
        "traffic": lambda: traffic_stream_config(prefix),
    }
    for kind in kinds:
        await _ensure_stream(js, configs[kind]())


async def wait_for_streams(
    js: JetStreamContext,
    prefix: str,
    kinds: tuple[StreamKind, ...],
    *,
    timeout_s: float = 10.0,
    poll_s: float = 0.5,
) -> None:
    """Return once every stream of ``kinds`` exists (their owners create them).

    Raises:
        Unavailable: one is still missing after ``timeout_s`` (its owner has not run yet).
        nats.errors.TimeoutError: JetStream did not answer.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    for kind in kinds:
        name = stream_name(prefix, kind)
        while True:
            try:
                await js.stream_info(name)
                break
            except nats.js.errors.NotFoundError:
                if loop.time() >= deadline:
                    owner = STREAM_OWNERS[kind]
                    raise Unavailable(f"no stream {name} yet (the {owner} creates it)") from None
                await asyncio.sleep(poll_s)


async def delete_streams(js: JetStreamContext, prefix: str) -> None:
    """Delete the streams of ``prefix`` if present (tests)."""
    for kind in STREAM_KINDS:
        name = stream_name(prefix, kind)
        try:
            await js.delete_stream(name)
        except nats.js.errors.NotFoundError:
            pass


def header(headers: dict[str, Any] | None, key: str) -> str | None:
    """One header value of a received message, or None."""
    if not headers:
        return None
    value = headers.get(key)
    return None if value is None else str(value)
