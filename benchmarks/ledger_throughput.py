"""Ledger benchmark: sustained append throughput (events/s) and replay speed (events/s).

Usage (from the repository root, with PostgreSQL reachable):

    python benchmarks/ledger_throughput.py [--database-url URL] [--seconds 20] [--writers 16]

It creates a scratch database next to the one URL names (default: the local server's
``postgres`` database), migrates it, and measures:

1. store appends: ``writers`` concurrent asyncio writers, each appending batches of
   ``--batch`` events to its own streams through ``EventStore.append`` (one transaction each);
2. gRPC appends: the same through a ``kiln serve ledger`` process (``LedgerClient.append``)
   over mutual TLS, as the service ``bench`` that a policy file lets append every event type
   (a PKI of its own in a temporary directory);
3. replay (verify mode) over everything written.

It prints one table; the scratch database is dropped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from integration.events_factory import compilation_story

from kiln.common.client import wait_healthy
from kiln.common.identity import Principal
from kiln.common.pki import ensure_deployment
from kiln.common.settings import KilnSettings
from kiln.common.tls import TlsMaterial, material_for
from kiln.events.registry import event_categories
from kiln.ledger.client import LedgerClient
from kiln.ledger.db import create_engine
from kiln.ledger.migrate import sync_url, upgrade
from kiln.ledger.model import NewEvent
from kiln.ledger.replay import replay
from kiln.ledger.store import EventStore

Append = Callable[[str, list[NewEvent]], Awaitable[object]]


async def sustained(
    append: Append, seconds: float, writers: int, batch: int
) -> tuple[float, list[float]]:
    """Events/s over ``seconds`` with ``writers`` concurrent writers, and the latency of each
    append (ms)."""
    deadline = time.perf_counter() + seconds
    counts = [0] * writers
    latencies: list[float] = []
    rng = random.Random(0)

    async def writer(w: int) -> None:
        while time.perf_counter() < deadline:
            cid = uuid.uuid4().hex[:16]
            for stream, evs in compilation_story(rng, cid, f"wk-{w}", n_experiments=4):
                for i in range(0, len(evs), batch):
                    t0 = time.perf_counter()
                    await append(stream, evs[i : i + batch])
                    latencies.append((time.perf_counter() - t0) * 1e3)
                    counts[w] += len(evs[i : i + batch])

    t0 = time.perf_counter()
    await asyncio.gather(*(writer(w) for w in range(writers)))
    return sum(counts) / (time.perf_counter() - t0), latencies


def _bench_security(tmp: Path) -> tuple[dict[str, str], TlsMaterial]:
    """A PKI (the ledger and the service ``bench``) and a policy letting ``bench`` append every
    event type: the server's environment and the client's certificate."""
    ensure_deployment(tmp / "pki", ("ledger", "bench"))
    by_category: dict[str, list[str]] = {}
    for event_type, category in event_categories().items():
        by_category.setdefault(category, []).append(event_type)
    policy = tmp / "policy.toml"
    policy.write_text(
        "".join(
            f'[[append]]\nservice = "bench"\ncategory = "{c}"\ntypes = {json.dumps(types)}\n'
            for c, types in by_category.items()
        )
    )
    settings = KilnSettings(pki_dir=tmp / "pki")
    tls = material_for(settings, Principal("service", "bench"))
    assert tls is not None
    return {"KILN_PKI_DIR": str(tmp / "pki"), "KILN_POLICY_FILE": str(policy)}, tls


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def main(args: argparse.Namespace) -> None:
    admin = sync_url(args.database_url).replace("postgresql+psycopg://", "postgresql://")
    name = f"kiln_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = args.database_url.rsplit("/", 1)[0] + f"/{name}"
    rows: list[tuple[str, str]] = []
    try:
        upgrade(url)
        engine = create_engine(url, pool_size=args.writers)
        store = EventStore(engine)

        async def store_append(stream: str, evs: list[NewEvent]) -> object:
            return await store.append(stream, evs, "any", team="bench")

        rate, lat = await sustained(store_append, args.seconds, args.writers, args.batch)
        rows.append(
            (
                "store append",
                f"{rate:,.0f} events/s  (p50 {statistics.median(lat):.1f} ms, "
                f"p99 {statistics.quantiles(lat, n=100)[98]:.1f} ms per append)",
            )
        )

        # The service in its own process, as deployed (client and server would share a core
        # and an event loop otherwise).
        addr = f"127.0.0.1:{_free_port()}"
        secrets = Path(tempfile.mkdtemp(prefix="kiln-bench-"))
        security, tls = _bench_security(secrets)
        env = {
            **os.environ,
            **security,
            "KILN_DATABASE_URL": url,
            "KILN_NATS_URL": args.nats_url,
            "KILN_SUBJECT_PREFIX": "kbench",
            "KILN_METRICS_PORT": "0",
            "KILN_LOG_LEVEL": "warning",
        }
        server = subprocess.Popen(
            [sys.executable, "-m", "kiln", "serve", "ledger", "--listen", addr],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            await wait_healthy(addr, timeout_s=30, tls=tls)
            async with LedgerClient(addr, "bench", tls=tls) as client:

                async def grpc_append(stream: str, evs: list[NewEvent]) -> object:
                    return await client.append(stream, evs)

                rate, lat = await sustained(grpc_append, args.seconds, args.writers, args.batch)
        finally:
            server.terminate()
            server.wait(30)
            shutil.rmtree(secrets, ignore_errors=True)
        rows.append(
            (
                "gRPC append",
                f"{rate:,.0f} events/s  (p50 {statistics.median(lat):.1f} ms, "
                f"p99 {statistics.quantiles(lat, n=100)[98]:.1f} ms per append)",
            )
        )

        total = await store.head_position()
        report = await replay(engine)
        rows.append(
            (
                "replay (verify)",
                f"{report.events_replayed / report.duration_s:,.0f} events/s "
                f"({report.events_replayed:,} events in {report.duration_s:.1f} s, "
                f"equal={report.equal})",
            )
        )
        rows.append(("events in ledger", f"{total:,}"))
        await engine.dispose()
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    print(
        f"\nledger benchmark: {args.writers} writers, batch {args.batch}, "
        f"{args.seconds:.0f} s per phase"
    )
    for label, value in rows:
        print(f"  {label:<20} {value}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--database-url", default="postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
    )
    parser.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--writers", type=int, default=16)
    parser.add_argument(
        "--batch", type=int, default=1, help="events per append (max of a story step)"
    )
    asyncio.run(main(parser.parse_args()))
