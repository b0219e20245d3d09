"""The traffic feed: observed requests of one deployment on NATS subject
``{prefix}.traffic.{deployment id}`` (JetStream stream ``{PREFIX}_TRAFFIC``, kept a week), so
records survive an agent runner's restart and a serving system may publish there directly.

A message is UTF-8 JSON: one record ``{"arrival_s": s, "isl": n, "osl": n, "hash_ids": [...],
"expert_counts": {"<expert>": tokens}}``, or ``{"records": [record, ...]}``, or
``{"flush": true}`` (the end of a file: the controller closes its open windows). ``arrival_s``
is seconds on the deployment's traffic clock (any origin); ``hash_ids`` and ``expert_counts``
are optional. A malformed message or record is logged and skipped, never fatal.

Reading is an ordered consumer from a stream sequence (:meth:`TrafficFeed.follow`): the
controller records, with each window, the sequence to re-read from after a restart.
"""

from __future__ import annotations

import asyncio
import json
import math
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import nats
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from kiln.common import nats as kn
from kiln.common.logging import get_logger
from kiln.workloads.traffic.records import Request

log = get_logger("kiln.agent_runner.deployments.feed")

MAX_RECORDS_PER_MESSAGE = 500
"""Records ObserveTraffic packs into one NATS message at most."""
PUBLISH_ATTEMPTS = 4
"""Tries of one message's publish when JetStream's acknowledgement times out."""
MAX_HASH_IDS = 4096
"""Prefix block ids a record may carry (a 2M-token prompt at 512 tokens a block)."""


@dataclass(frozen=True)
class FeedMessage:
    """One message of the feed: its stream sequence, the records it held, and whether it asks
    the controller to close its open windows."""

    sequence: int
    requests: tuple[Request, ...]
    flush: bool = False


def encode_record(
    arrival_s: float,
    isl: int,
    osl: int,
    hash_ids: Sequence[int] = (),
    expert_counts: Mapping[int, int] | None = None,
) -> dict[str, Any]:
    """One record as the feed's JSON object."""
    record: dict[str, Any] = {"arrival_s": arrival_s, "isl": isl, "osl": osl}
    if hash_ids:
        record["hash_ids"] = list(hash_ids)
    if expert_counts:
        record["expert_counts"] = {str(k): int(v) for k, v in expert_counts.items()}
    return record


def decode_record(obj: Any) -> Request:
    """The :class:`Request` of one record object; ValueError naming the problem. Expert counts
    are accepted but not part of a request's shape (request traces carry no routing)."""
    if not isinstance(obj, dict):
        raise ValueError("a traffic record is a JSON object")
    arrival, isl, osl = obj.get("arrival_s"), obj.get("isl"), obj.get("osl")
    if not isinstance(arrival, (int, float)) or not math.isfinite(arrival):
        raise ValueError(f"arrival_s must be a finite number, got {arrival!r}")
    for name, value in (("isl", isl), ("osl", osl)):
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**32:
            raise ValueError(f"{name} must be an integer in [0, 2^32), got {value!r}")
    hashes = obj.get("hash_ids") or []
    if not isinstance(hashes, list) or len(hashes) > MAX_HASH_IDS:
        raise ValueError(f"hash_ids must be a list of at most {MAX_HASH_IDS} integers")
    if not all(isinstance(h, int) and not isinstance(h, bool) for h in hashes):
        raise ValueError("hash_ids must be integers")
    assert isinstance(isl, int) and isinstance(osl, int)
    return Request(float(arrival), isl, osl, tuple(hashes))


def decode_message(sequence: int, data: bytes) -> FeedMessage:
    """The records of one message (malformed ones skipped and logged)."""
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        log.warning("traffic.bad_message", sequence=sequence, error="not JSON")
        return FeedMessage(sequence, ())
    if isinstance(obj, dict) and obj.get("flush") is True:
        return FeedMessage(sequence, (), flush=True)
    items = obj.get("records") if isinstance(obj, dict) and "records" in obj else [obj]
    if not isinstance(items, list):
        log.warning("traffic.bad_message", sequence=sequence, error="records is not a list")
        return FeedMessage(sequence, ())
    out = []
    for item in items:
        try:
            out.append(decode_record(item))
        except ValueError as exc:
            log.warning("traffic.bad_record", sequence=sequence, error=str(exc))
    return FeedMessage(sequence, tuple(out))


class TrafficFeed:
    """Publishing to and reading from the deployments' traffic subjects under ``prefix``."""

    def __init__(self, js: JetStreamContext, prefix: str) -> None:
        self._js = js
        self._prefix = prefix
        self._stream = kn.traffic_stream_name(prefix)

    def subject(self, deployment_id: str) -> str:
        """``{prefix}.traffic.{deployment_id}``."""
        return kn.traffic_subject(self._prefix, deployment_id)

    async def publish(self, deployment_id: str, records: Sequence[dict[str, Any]]) -> int:
        """Publish ``records`` (encoded objects) in messages of at most
        :data:`MAX_RECORDS_PER_MESSAGE`, each acknowledged by JetStream (stored) before the
        next; returns the last message's stream sequence (0 when none was sent). Each message
        carries a ``Nats-Msg-Id``, so a publish retried after a lost acknowledgement is stored
        once; nats errors propagate after :data:`PUBLISH_ATTEMPTS` tries."""
        seq = 0
        for i in range(0, len(records), MAX_RECORDS_PER_MESSAGE):
            chunk = list(records[i : i + MAX_RECORDS_PER_MESSAGE])
            body = json.dumps({"records": chunk}, separators=(",", ":")).encode()
            seq = await self._publish(deployment_id, body)
        return seq

    async def publish_flush(self, deployment_id: str) -> None:
        """Ask the controller to close the open windows (the end of a file)."""
        await self._publish(deployment_id, b'{"flush":true}')

    async def _publish(self, deployment_id: str, body: bytes) -> int:
        """One message, retried on a timeout under its one message id; its stream sequence."""
        headers = {kn.MSG_ID: f"traffic:{uuid.uuid4().hex}"}
        async for attempt in AsyncRetrying(
            retry=retry_if_exception_type((nats.errors.TimeoutError, asyncio.TimeoutError)),
            stop=stop_after_attempt(PUBLISH_ATTEMPTS),
            wait=wait_exponential(multiplier=0.2, max=2.0),
            reraise=True,
        ):
            with attempt:
                ack = await self._js.publish(
                    self.subject(deployment_id), body, stream=self._stream, headers=headers
                )
        return int(ack.seq)

    async def last_arrival(self, deployment_id: str) -> float | None:
        """The largest ``arrival_s`` of the subject's last message, None when it has none."""
        try:
            msg = await self._js.get_last_msg(self._stream, self.subject(deployment_id))
        except nats.js.errors.NotFoundError:
            return None
        decoded = decode_message(msg.seq or 0, msg.data or b"")
        return max((r.arrival_s for r in decoded.requests), default=None)

    async def follow(
        self, deployment_id: str, start_sequence: int = 1
    ) -> AsyncIterator[FeedMessage]:
        """The subject's messages from stream sequence ``start_sequence`` on, stored then live;
        never ends on its own (close it to drop the consumer)."""
        subject = self.subject(deployment_id)
        config = ConsumerConfig(filter_subject=subject)
        if start_sequence > 1:
            config.deliver_policy = DeliverPolicy.BY_START_SEQUENCE
            config.opt_start_seq = start_sequence
        else:
            config.deliver_policy = DeliverPolicy.ALL
        sub = await self._js.subscribe(
            subject, stream=self._stream, config=config, ordered_consumer=True
        )
        try:
            while True:
                try:
                    msg = await sub.next_msg(timeout=1.0)
                except nats.errors.TimeoutError:
                    continue
                yield decode_message(msg.metadata.sequence.stream, msg.data)
        finally:
            await sub.unsubscribe()
