"""The board client agents use: post ideas, claim a candidate once, read and follow.

The board carries ideas and claims only (results are the ledger's). Posts carry a
``Nats-Msg-Id``, so a retried post is stored once; a claim also carries
``Nats-Expected-Last-Subject-Sequence: 0``, so exactly one agent ever wins a candidate.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import AsyncGenerator, Iterable
from typing import Any, Final

import nats.errors
import structlog
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.errors import APIError, NotFoundError
from pydantic import ValidationError

from kiln.board.post import BoardPost
from kiln.common import nats as kn
from kiln.common.errors import InvalidArgument

log = structlog.get_logger(__name__)

EXPECTED_LAST_SUBJECT_SEQUENCE: Final = "Nats-Expected-Last-Subject-Sequence"
WRONG_LAST_SEQUENCE: Final = 10071
"""JetStream's error code when ``Nats-Expected-Last-Subject-Sequence`` does not hold."""

_AGENT_RE = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


def _check_agent(agent: str) -> str:
    if not isinstance(agent, str) or not _AGENT_RE.match(agent):
        raise InvalidArgument(f"invalid agent {agent!r}: expected 1-128 chars of [A-Za-z0-9_.-]")
    return agent


def _digest(body: dict[str, Any]) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


class Board:
    """The message board of one subject prefix; the board stream must exist.

    ``timeout_s``: longest wait for a PubAck or the next stored message. Invalid ids raise
    InvalidArgument; NATS failures propagate (``nats.errors.Error``,
    ``nats.js.errors.APIError``).
    """

    def __init__(
        self, js: JetStreamContext, prefix: str = "kiln", *, timeout_s: float = 5.0
    ) -> None:
        self._js = js
        self._prefix = prefix
        self._stream = kn.board_stream_name(prefix)
        self._timeout_s = timeout_s

    # --- writing -------------------------------------------------------------------------
    async def _post(self, post: BoardPost, headers: dict[str, str]) -> BoardPost:
        subject = kn.board_subject(self._prefix, post.compilation_id, post.kind, post.candidate_id)
        ack = await self._js.publish(
            subject, post.to_json(), timeout=self._timeout_s, stream=self._stream, headers=headers
        )
        return post.model_copy(update={"seq": ack.seq})

    def _new(
        self,
        kind: kn.BoardKind,
        compilation_id: str,
        candidate_id: str,
        agent: str,
        body: dict[str, Any] | None,
    ) -> BoardPost:
        kn.check_id("compilation id", compilation_id)
        kn.check_id("candidate id", candidate_id)
        _check_agent(agent)
        return BoardPost(
            kind=kind,
            compilation_id=compilation_id,
            candidate_id=candidate_id,
            agent=agent,
            body=dict(body or {}),
        )

    async def post_idea(
        self,
        compilation_id: str,
        candidate_id: str,
        agent: str,
        body: dict[str, Any] | None = None,
        *,
        msg_id: str | None = None,
    ) -> BoardPost:
        """Propose a candidate; the same idea resent (or ``msg_id``) is stored once. Returns the
        post with its stream ``seq`` (the original's for a duplicate).
        """
        post = self._new("idea", compilation_id, candidate_id, agent, body)
        mid = msg_id or f"idea:{compilation_id}:{candidate_id}:{agent}:{_digest(post.body)}"
        return await self._post(post, {kn.MSG_ID: mid})

    async def claim(
        self, compilation_id: str, candidate_id: str, agent: str, body: dict[str, Any] | None = None
    ) -> bool:
        """Take a candidate; at most one agent ever holds it.

        Returns True if ``agent`` holds the claim (now or before, so a retry stays True), False
        if another agent does. Raises InvalidArgument on a bad id, NATS errors otherwise.
        """
        post = self._new("claim", compilation_id, candidate_id, agent, body)
        headers = {
            kn.MSG_ID: f"claim:{compilation_id}:{candidate_id}:{agent}",
            EXPECTED_LAST_SUBJECT_SEQUENCE: "0",
        }
        try:
            await self._post(post, headers)
            return True
        except APIError as exc:
            if exc.err_code != WRONG_LAST_SEQUENCE:
                raise
        return await self.claim_holder(compilation_id, candidate_id) == agent

    # --- reading ----------------------------------------------------------------------------
    async def claim_holder(self, compilation_id: str, candidate_id: str) -> str | None:
        """The agent holding the claim on a candidate, or None if it is unclaimed."""
        subject = kn.board_subject(self._prefix, compilation_id, "claim", candidate_id)
        try:
            raw = await self._js.get_last_msg(self._stream, subject)
        except NotFoundError:
            return None
        try:
            return BoardPost.model_validate_json(raw.data or b"").agent
        except ValidationError:
            log.warning("board.bad_claim", subject=subject)
            return None

    async def claimed(self, compilation_id: str) -> set[str]:
        """Ids of the candidates of a compilation that have been claimed (one stream query)."""
        filt = kn.board_filter(self._prefix, compilation_id, "claim")
        info = await self._js.stream_info(self._stream, subjects_filter=filt)
        return {s.rsplit(".", 1)[1] for s in (info.state.subjects or {})}

    async def history(
        self, compilation_id: str, kinds: Iterable[str] | None = None
    ) -> list[BoardPost]:
        """Every post of a compilation stored when the call started, in stream order; ``kinds``
        (None = all) filters. InvalidArgument on an unknown kind.
        """
        filt, wanted = self._filter(compilation_id, kinds)
        last = (await self._js.stream_info(self._stream)).state.last_seq
        if last == 0:
            return []
        posts: list[BoardPost] = []
        sub = await self._subscribe(filt, 1)
        try:
            info = await sub.consumer_info()
            if not info.num_pending and not (info.delivered and info.delivered.stream_seq):
                return []
            while True:
                try:
                    msg = await sub.next_msg(timeout=self._timeout_s)
                except nats.errors.TimeoutError:
                    if not (await sub.consumer_info()).num_pending:
                        break
                    continue
                meta = msg.metadata
                if meta.sequence.stream > last:
                    break
                post = self._decode(msg)
                if post is not None and post.kind in wanted:
                    posts.append(post)
                if meta.sequence.stream >= last or meta.num_pending == 0:
                    break
        finally:
            await sub.unsubscribe()
        return posts

    async def follow(
        self, compilation_id: str, kinds: Iterable[str] | None = None, since_seq: int = 0
    ) -> AsyncGenerator[BoardPost, None]:
        """Posts with stream seq > ``since_seq``: the stored ones, then live; never ends on its
        own (close it to drop the consumer). ConnectionClosedError when NATS closes.
        """
        filt, wanted = self._filter(compilation_id, kinds)
        sub = await self._subscribe(filt, max(0, since_seq) + 1)
        try:
            while True:
                try:
                    msg = await sub.next_msg(timeout=1.0)
                except nats.errors.TimeoutError:
                    continue
                post = self._decode(msg)
                if post is not None and post.kind in wanted:
                    yield post
        finally:
            await sub.unsubscribe()

    # --- helpers ---------------------------------------------------------------------------
    def _filter(self, compilation_id: str, kinds: Iterable[str] | None) -> tuple[str, set[str]]:
        wanted = set(kn.BOARD_KINDS if kinds is None else kinds)
        if not wanted:
            raise InvalidArgument("kinds must name at least one of idea, claim")
        for k in wanted:
            kn.board_filter(self._prefix, compilation_id, k)  # validates
        one = next(iter(wanted)) if len(wanted) == 1 else None
        # A single filter subject per consumer (works on NATS 2.9; filter_subjects needs 2.10).
        return kn.board_filter(self._prefix, compilation_id, one), wanted

    async def _subscribe(self, filt: str, start_seq: int) -> JetStreamContext.PushSubscription:
        config = ConsumerConfig(filter_subject=filt)
        if start_seq > 1:
            config.deliver_policy = DeliverPolicy.BY_START_SEQUENCE
            config.opt_start_seq = start_seq
        else:
            config.deliver_policy = DeliverPolicy.ALL
        return await self._js.subscribe(
            filt, stream=self._stream, config=config, ordered_consumer=True
        )

    def _decode(self, msg: Msg) -> BoardPost | None:
        try:
            cid, kind, cand = kn.parse_board_subject(self._prefix, msg.subject)
            post = BoardPost.model_validate_json(msg.data)
        except (InvalidArgument, ValidationError) as exc:
            log.warning("board.bad_post", subject=msg.subject, error=str(exc))
            return None
        return post.model_copy(
            update={
                "kind": kind,
                "compilation_id": cid,
                "candidate_id": cand,
                "seq": msg.metadata.sequence.stream,
            }
        )
