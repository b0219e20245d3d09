"""Backing servers for the tests: the running PostgreSQL and NATS when present, else embedded.

Set ``KILN_TEST_EMBEDDED=1`` to force the embedded servers (CI runs the suite both ways).
Set ``KILN_TEST_DATABASE_URL`` / ``KILN_TEST_NATS_URL`` to use other servers.
Each test session gets its own database (dropped at the end) and its own NATS subject prefix,
so sessions and the developer's own data never meet.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kiln.common.settings import KilnSettings

from . import pki
from .databases import scratch_database

pki.install()  # before any test builds settings or a channel: every test runs over mTLS

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"


def _cuda_present() -> bool:
    """True when the NVIDIA driver is visible (without importing torch here)."""
    return Path("/proc/driver/nvidia/version").exists() or bool(shutil.which("nvidia-smi"))


if not _cuda_present():
    # Triton kernels run on CPU tensors only through Triton's interpreter, which Triton reads
    # when a kernel is defined: set it before any test module imports kiln's kernels.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def _force_embedded() -> bool:
    return os.environ.get("KILN_TEST_EMBEDDED", "") not in ("", "0", "false")


@pytest.fixture(scope="session", autouse=True)
def session_pki() -> Iterator[Path]:
    """The session's PKI directory (tests/pki.py), removed at the end."""
    try:
        yield pki.pki_dir()
    finally:
        pki.remove()


@pytest.fixture(autouse=True)
def test_client_identity() -> Iterator[None]:
    """Each test starts with the process's client identity of tests/pki.py (a CLI command run
    in-process, or ``kiln.common.server.run``, replaces the process default)."""
    pki.reset_client_identity()
    yield


@pytest.fixture(scope="session")
def embedded_dir() -> Iterator[Path]:
    """Data of the embedded servers, outside pytest's base temp dir: as root the embedded
    PostgreSQL runs as another user that must reach it, and any pytest session that starts
    meanwhile resets that base dir to mode 0700."""
    path = Path(tempfile.mkdtemp(prefix="kiln-test-embedded-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres_server_url(embedded_dir: Path) -> Iterator[str]:
    """URL of a PostgreSQL server's maintenance database ``postgres``."""
    explicit = os.environ.get("KILN_TEST_DATABASE_URL")
    if explicit:
        yield explicit
        return
    if not _force_embedded() and _port_open("127.0.0.1", 5432):
        yield "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
        return
    from kiln.embedded.postgres import EmbeddedPostgres, free_port

    pg = EmbeddedPostgres(embedded_dir / "pg", port=free_port())
    url = pg.start()
    try:
        yield url
    finally:
        pg.stop()


@pytest.fixture(scope="session")
def database_url(postgres_server_url: str) -> Iterator[str]:
    """A fresh, migrated database for this test session."""
    with scratch_database(postgres_server_url) as url:
        yield url


@pytest.fixture(scope="session")
def nats_url(embedded_dir: Path) -> Iterator[str]:
    """URL of a NATS server with JetStream."""
    explicit = os.environ.get("KILN_TEST_NATS_URL")
    if explicit:
        yield explicit
        return
    if not _force_embedded() and _port_open("127.0.0.1", 4222):
        yield "nats://127.0.0.1:4222"
        return
    from kiln.embedded.nats import EmbeddedNats
    from kiln.embedded.postgres import free_port

    server = EmbeddedNats(embedded_dir / "nats", port=free_port())
    url = server.start()
    try:
        yield url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def subject_prefix() -> str:
    """A NATS subject prefix private to this test session."""
    return "kt" + uuid.uuid4().hex[:10]


@pytest.fixture(scope="session")
def settings(
    database_url: str, nats_url: str, subject_prefix: str, tmp_path_factory
) -> KilnSettings:
    """Settings pointing at this session's database, NATS and prefix."""
    return KilnSettings(
        database_url=database_url,
        nats_url=nats_url,
        subject_prefix=subject_prefix,
        state_dir=tmp_path_factory.mktemp("state"),
        team="test-team",
        log_format="console",
    )


HEAVY_FILES = (
    "tests/e2e/",
    "tests/unit/test_red_team.py",
    "tests/unit/test_moe_gate.py",
    "tests/unit/test_fused_decode.py",
    "tests/integration/test_fairness.py",
    "tests/unit/test_gpt_oss_model.py",
    "tests/unit/test_space_support.py",
    "tests/integration/test_warm_start_grpc.py",
)
"""Files dispatched to the workers first (``--dist loadfile`` hands files out in collection
order): a long file started last kept one worker busy minutes after the other had finished."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The :data:`HEAVY_FILES` first, in that order; every other file, and the tests inside
    each file, keep their order."""

    def rank(item: pytest.Item) -> int:
        path = item.nodeid.split("::", 1)[0]
        return next((i for i, p in enumerate(HEAVY_FILES) if path.startswith(p)), len(HEAVY_FILES))

    items.sort(key=rank)
