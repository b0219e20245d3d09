"""Stream setup and subject names against a real NATS JetStream."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from kiln.common import nats as kn
from kiln.common.errors import InvalidArgument

pytestmark = pytest.mark.integration


async def test_ensure_streams_is_idempotent_concurrent_and_updates(
    nats_url: str, subject_prefix: str
) -> None:
    prefix = f"{subject_prefix}_{uuid.uuid4().hex[:6]}"
    clients = [await kn.connect(nats_url, f"ensure-{i}") for i in range(4)]
    js = clients[0].jetstream()
    try:
        await asyncio.gather(*(kn.ensure_streams(c.jetstream(), prefix) for c in clients))
        await kn.ensure_streams(js, prefix)  # identical config again
        info = await js.stream_info(kn.events_stream_name(prefix))
        assert info.config.subjects == [f"{prefix}.events.>"]
        assert info.config.storage == "file"
        assert info.config.duplicate_window == kn.EVENTS_DUPLICATE_WINDOW_S
        board = await js.stream_info(kn.board_stream_name(prefix))
        assert board.config.subjects == [f"{prefix}.board.>"]

        await kn.ensure_streams(js, prefix, events_duplicate_window_s=30.0)  # changed: updated
        info = await js.stream_info(kn.events_stream_name(prefix))
        assert info.config.duplicate_window == 30.0
    finally:
        await kn.delete_streams(js, prefix)
        for c in clients:
            await c.close()


def test_names() -> None:
    assert kn.events_stream_name("kiln") == "KILN_EVENTS"
    assert kn.board_stream_name("kiln") == "KILN_BOARD"
    assert (
        kn.events_subject("kiln", "compilation-7f3a_b-c", "CompilationSubmitted")
        == "kiln.events.compilation.compilation-7f3a_b-c.CompilationSubmitted"
    )
    assert kn.events_filter("kiln") == "kiln.events.>"
    assert kn.events_filter("kiln", category="experiment") == "kiln.events.experiment.*.*"
    assert (
        kn.events_filter("kiln", stream_id="compilation-7", event_type="CompilationEnded")
        == "kiln.events.compilation.compilation-7.CompilationEnded"
    )
    assert kn.events_filter("kiln", event_type="ExperimentCompleted") == (
        "kiln.events.*.*.ExperimentCompleted"
    )
    for bad in (
        {"category": "Experiment"},
        {"category": "experiment.*"},
        {"stream_id": "compilation-*"},
        {"stream_id": "experiment-1", "category": "compilation"},
        {"event_type": ">"},
    ):
        with pytest.raises(InvalidArgument):
            kn.events_filter("kiln", **bad)
    assert kn.board_subject("kiln", "c1", "claim", "x-1") == "kiln.board.c1.claim.x-1"
    assert kn.board_filter("kiln", "c1") == "kiln.board.c1.>"
    assert kn.board_filter("kiln", "c1", "idea") == "kiln.board.c1.idea.*"
    assert kn.parse_board_subject("kiln", "kiln.board.c1.idea.x") == ("c1", "idea", "x")
    for bad in ("Compilation-1", "compilation", "compilation-a.b", "compilation-*"):
        with pytest.raises(InvalidArgument):
            kn.events_subject("kiln", bad, "T")
    with pytest.raises(InvalidArgument):
        kn.events_subject("kiln", "compilation-1", "Bad.Type")
    for kind in ("vote", "result"):  # the board carries ideas and claims only
        with pytest.raises(InvalidArgument):
            kn.board_subject("kiln", "c1", kind, "x")
    with pytest.raises(InvalidArgument):
        kn.parse_board_subject("kiln", "kiln.board.c1.result.x")
    with pytest.raises(InvalidArgument):
        kn.events_stream_name("Bad")
