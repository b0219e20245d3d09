"""``pip install kiln`` is the gRPC client alone: the wheel built from this checkout, installed
into a fresh virtual environment without extras, brings the kiln.v1 stubs and
:mod:`kiln.common.client` but none of the servers' dependencies (the ``server`` extra), and a
script there calls a real Compiler (the agent runner, with the real ledger, cost model and an
engine pool of simulated engines, served in this test's process) over mutual TLS as a team."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from kiln.common.identity import Principal
from kiln.common.pki import CA_CERT, CERT, KEY, identity_dir
from kiln.common.settings import KilnSettings

from .. import pki
from .pool_stack import pool_stack

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
TEAM = "client-team"
SERVER_ONLY = (
    "sqlalchemy", "optuna", "nats", "alembic", "psycopg", "typer", "rich", "tenacity", "psutil",
    "prometheus_client", "httpx", "grpc_reflection", "torch",
)  # fmt: skip
"""Import names of the ``server`` extra (and the ``engine`` one) that a client must not get."""

CLIENT_SCRIPT = textwrap.dedent(
    """
    import asyncio, importlib.util, sys

    import grpc

    import kiln.common.client
    from kiln.common.client import team_channel, wait_healthy
    from kiln.v1 import (
        common_pb2_grpc, compiler_pb2, compiler_pb2_grpc, cost_model_pb2_grpc,
        deployments_pb2_grpc, engine_pool_pb2_grpc, ledger_pb2_grpc,
    )

    absent = sys.argv[2].split(",")
    installed = [name for name in absent if importlib.util.find_spec(name) is not None]
    loaded = sorted({m.split(".")[0] for m in sys.modules} & set(absent))
    print("installed:", installed, "loaded:", loaded)
    print("from", kiln.common.client.__file__)

    async def main(addr: str) -> None:
        await wait_healthy(addr, 20)
        async with team_channel(addr, "{team}") as ch:
            stub = compiler_pb2_grpc.CompilerStub(ch)
            listed = await stub.List(compiler_pb2.ListRequest(), timeout=20)
            print("listed", len(listed.compilations))
            try:
                await stub.Get(compiler_pb2.GetRequest(compilation_id="no-such-one"), timeout=20)
            except grpc.aio.AioRpcError as err:
                print("get", err.code().name, err.details())
            try:
                await stub.Submit(compiler_pb2.SubmitRequest(), timeout=20)
            except grpc.aio.AioRpcError as err:
                print("submit", err.code().name, err.details())

    asyncio.run(main(sys.argv[1]))
    """
).replace("{team}", TEAM)


def _clean_env(**extra: str) -> dict[str, str]:
    """This environment without Python paths or kiln settings (the client sets its own)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("KILN_", "PYTHON", "VIRTUAL_ENV")) or k == "PYTHONUNBUFFERED"
    }
    return env | extra


@pytest.fixture(scope="module")
def client_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment holding ``pip install <this checkout's wheel>`` only; its
    bin directory. Built before any server starts (this blocks the event loop)."""
    root = tmp_path_factory.mktemp("client-install")
    # Built from a copy: an in-tree build shares build/ with test_wheel_migrations on the other
    # xdist worker.
    src = root / "src"
    shutil.copytree(
        REPO / "services",
        src / "services",
        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"),
    )
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, src / name)
    run = {"check": True, "capture_output": True, "text": True, "env": _clean_env()}
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(root / "dist"), str(src)],
        timeout=240, **run,
    )  # fmt: skip
    (wheel,) = (root / "dist").glob("kiln-*.whl")
    subprocess.run([sys.executable, "-m", "venv", str(root / "venv")], timeout=120, **run)
    bin_dir = root / "venv" / "bin"
    subprocess.run(
        [str(bin_dir / "python"), "-m", "pip", "install", "--no-cache-dir", "-q", str(wheel)],
        timeout=240, **run,
    )  # fmt: skip
    return bin_dir


def test_the_wheel_ships_the_license(client_venv: Path) -> None:
    (wheel,) = (client_venv.parents[1] / "dist").glob("kiln-*.whl")
    with zipfile.ZipFile(wheel) as whl:
        (name,) = [n for n in whl.namelist() if n.endswith(".dist-info/licenses/LICENSE")]
        assert whl.read(name) == (REPO / "LICENSE").read_bytes()
        metadata = whl.read(name.replace("licenses/LICENSE", "METADATA")).decode()
    assert "License-Expression: Apache-2.0" in metadata.splitlines()


def test_the_client_install_has_no_server_dependencies(client_venv: Path) -> None:
    listed = subprocess.run(
        [str(client_venv / "python"), "-m", "pip", "list", "--format=freeze"],
        capture_output=True, text=True, timeout=60, check=True, env=_clean_env(),
    ).stdout.lower()  # fmt: skip
    names = {line.split("==")[0].replace("_", "-") for line in listed.splitlines()}
    assert {"kiln", "grpcio", "protobuf", "cryptography"} <= names
    heavy = {"sqlalchemy", "optuna", "nats-py", "alembic", "psycopg", "typer", "rich", "torch"}
    assert not names & heavy, f"the client install has server packages: {names & heavy}"
    # The console script is there but the CLI needs the server extra: one line says so.
    done = subprocess.run(
        [str(client_venv / "kiln"), "--help"],
        capture_output=True, text=True, timeout=60, check=False, env=_clean_env(),
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert "pip install 'kiln[server]'" in done.stderr
    assert "Traceback" not in done.stderr


async def test_a_client_install_calls_the_compiler(
    client_venv: Path, settings: KilnSettings
) -> None:
    pki.team_tls(TEAM)  # the team's certificate, as `kiln credentials issue --team` writes it
    files = identity_dir(pki.pki_dir(), Principal("team", TEAM))
    # The README's way: the three files and KILN_TEAM, no PKI directory.
    env = _clean_env(
        KILN_TLS_CA_FILE=str(files / CA_CERT),
        KILN_TLS_CERT_FILE=str(files / CERT),
        KILN_TLS_KEY_FILE=str(files / KEY),
        KILN_TEAM=TEAM,
    )
    async with pool_stack(settings, "cl") as stack:
        await stack.start_runner()
        proc = await asyncio.create_subprocess_exec(
            str(client_venv / "python"), "-c", CLIENT_SCRIPT, stack.runner_addr,
            ",".join(SERVER_ONLY),
            cwd=client_venv.parent, env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(), 90)
    lines = out.decode().splitlines()
    assert proc.returncode == 0, err.decode()[-3000:]
    assert lines[0] == "installed: [] loaded: []"
    assert lines[1].startswith(f"from {client_venv.parent}/lib/"), lines  # the wheel's copy
    assert lines[2] == "listed 0"
    assert lines[3].startswith("get NOT_FOUND "), lines
    assert "no-such-one" in lines[3]
    assert lines[4].startswith("submit INVALID_ARGUMENT "), lines
    assert "workload is missing" in lines[4]
