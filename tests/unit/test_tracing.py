"""kiln.common.tracing: off unless configured, untrusted trace context ignored, service names."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from kiln.common import tracing

pytest.importorskip("opentelemetry.sdk", reason="the `tracing` extra is not installed")

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)

VALID = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    """Tracing on in this process, into memory, for the test only."""
    found = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(found))
    before = tracing._provider
    tracing.install(provider)
    try:
        yield found
    finally:
        tracing.install(before)


@pytest.mark.parametrize(
    "headers",
    [
        None,
        {},
        {"traceparent": "garbage"},
        {"traceparent": ""},
        {"traceparent": "00-" + "0" * 32 + "-" + "0" * 16 + "-01"},  # all-zero ids are invalid
        {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7"},  # no flags
        {"traceparent": "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"},  # version ff
        {"traceparent": "00-XYZ92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"},
        {"traceparent": VALID + "\n" + "x" * 100_000},
        {"traceparent": b"not a str"},
        {"traceparent": ["a", "list"]},
        {b"traceparent": VALID},
        {"tracestate": "k=v"},
    ],
)
def test_a_malformed_traceparent_is_ignored(
    exporter: InMemorySpanExporter, headers: object
) -> None:
    """extract() gives no parent and never raises; the span then starts a trace of its own."""
    parent = tracing.extract(headers)  # type: ignore[arg-type]
    assert parent is None
    with tracing.span("kiln.experiment.run", kind="consumer", parent=parent) as span:
        assert span is not None
    (finished,) = exporter.get_finished_spans()
    assert finished.parent is None
    assert f"{finished.context.trace_id:032x}" != VALID.split("-")[1]


def test_a_valid_traceparent_is_continued(exporter: InMemorySpanExporter) -> None:
    parent = tracing.extract({"traceparent": VALID, "Nats-Msg-Id": "e1"})
    with tracing.span("kiln.experiment.run", kind="consumer", parent=parent):
        pass
    (finished,) = exporter.get_finished_spans()
    assert f"{finished.context.trace_id:032x}" == VALID.split("-")[1]
    assert finished.parent is not None and f"{finished.parent.span_id:016x}" == VALID.split("-")[2]


def test_inject_carries_the_current_span(exporter: InMemorySpanExporter) -> None:
    with tracing.span("kiln.experiment.dispatch", kind="producer", experiment_id="e1") as span:
        headers = tracing.inject({"Nats-Msg-Id": "e1"})
    ctx = span.get_span_context()
    assert headers["Nats-Msg-Id"] == "e1"
    assert headers["traceparent"].startswith(f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-")


def test_only_kiln_ids_become_attributes(exporter: InMemorySpanExporter) -> None:
    with tracing.span(
        "x", compilation_id="c1", team="t", token="secret", password="p", candidate_id=""
    ):
        pass
    (finished,) = exporter.get_finished_spans()
    assert dict(finished.attributes or {}) == {"kiln.compilation_id": "c1", "kiln.team": "t"}


def test_off_when_not_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    """No OTEL_* variables: configure() leaves tracing off; spans, headers and interceptors are
    no-ops."""
    for key in list(os.environ):
        if key.startswith("OTEL_"):
            monkeypatch.delenv(key)
    before = tracing._provider
    tracing.install(None)
    try:
        assert tracing.configure("ledger") is False
        assert not tracing.enabled()
        with tracing.span("x", compilation_id="c1") as span:
            assert span is None
            assert tracing.inject({"a": "b"}) == {"a": "b"}
            assert tracing.capture() is None
        assert tracing.extract({"traceparent": VALID}) is None
        assert tracing.server_interceptors() == []
        assert tracing.client_interceptors() == []
    finally:
        tracing.install(before)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, "otlp"),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4317"}, "otlp"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_SDK_DISABLED": "true"}, None),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_TRACES_EXPORTER": "none"}, None),
        ({"OTEL_TRACES_EXPORTER": "console"}, "console"),
    ],
)
def test_which_exporter(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], expected: str
) -> None:
    for key in list(os.environ):
        if key.startswith("OTEL_"):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert tracing.read_settings().exporter() == expected


SCRIPT = """
from kiln.common import tracing
on = tracing.configure("agent-runner")
with tracing.span("kiln.compilation", compilation_id="c1"):
    pass
tracing.shutdown()
print("CONFIGURED", on)
"""


def _run(env: dict[str, str]) -> str:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env=clean | env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout


def test_a_process_exports_nothing_unless_configured() -> None:
    """A fresh process: without OTEL_* nothing is exported; with them it exports as
    kiln-<service> (the console exporter stands in for a collector)."""
    assert _run({}).strip() == "CONFIGURED False"
    out = _run({"OTEL_TRACES_EXPORTER": "console"})
    assert out.rstrip().endswith("CONFIGURED True")
    exported = json.loads(out[out.index("{\n") : out.rindex("CONFIGURED")])  # after the log
    assert exported["name"] == "kiln.compilation"
    assert exported["resource"]["attributes"]["service.name"] == "kiln-agent-runner"
    assert exported["attributes"] == {"kiln.compilation_id": "c1"}
    named = _run({"OTEL_TRACES_EXPORTER": "console", "OTEL_SERVICE_NAME": "my-runner"})
    assert '"service.name": "my-runner"' in named


def test_without_the_extra_tracing_stays_off() -> None:
    """No opentelemetry installed (hidden here): kiln imports, and tracing is a no-op even when
    the environment asks for it."""
    script = """
import sys
sys.modules["opentelemetry"] = None  # as if the `tracing` extra were not installed
from kiln.common import tracing
from kiln.common.client import channel
assert tracing.configure("ledger") is False
with tracing.span("x") as span:
    assert span is None
assert tracing.inject({}) == {} and tracing.extract({"traceparent": "x"}) is None
assert tracing.server_interceptors() == tracing.client_interceptors() == []
print("OFF")
"""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=clean | {"OTEL_TRACES_EXPORTER": "console"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and done.stdout.strip() == "OFF", done.stderr
