"""The sandbox as an unprivileged user (docs/design/engine.md, "Sandbox"): its uid, gid and
groups as the kernel reports them from outside (``/proc/<pid>/status``, not what the sandbox
says), and a candidate code module that tries to read a root-only file, write outside its
directory, connect to a listening socket, read the engine's environment secrets and become root
again: each refused or finding nothing, judged from outside where it can be (the files it would
have written, the listener's accept queue, the secrets' absence from all it reports). The
engine here is the real one with its real sandbox process.

As root (the embedded default) the sandbox becomes ``nobody`` (or ``KILN_SANDBOX_UID``); as
another user it keeps that user and says so in the measurement's notes, and the checks that
need root are skipped.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from kiln.domain.candidate import Candidate
from kiln.runtime.engine import Engine
from kiln.runtime.measurement import Measurement
from kiln.runtime.request import RunRequest
from kiln.runtime.sandbox.user import NOBODY, configured_user
from kiln.runtime.spec import EngineLimits, EngineSpec

from .engine_testing import HANDWRITTEN_MLP, module, tiny_workload

LIMITS = EngineLimits(max_batch=3, max_context=40, prompt_len=8, check_steps=1, check_batch=2)
ROOT = os.geteuid() == 0
SECRET = "kiln-secret-" + secrets.token_hex(8)
"""In the engine's environment (database URL, cloud key) and in the root-only file."""
needs_root = pytest.mark.skipif(not ROOT, reason="switching users needs the engine to be root")


def _ids(pid: int) -> dict[str, list[int]]:
    """Uid, Gid (real, effective, saved, fs) and Groups of ``pid`` as the kernel reports them."""
    out: dict[str, list[int]] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("Uid", "Gid", "Groups"):
            out[key] = [int(v) for v in value.split()]
    return out


@pytest.fixture(scope="module")
def places() -> Iterator[dict[str, Path]]:
    """Outside any pytest directory (those are 0700): a world-enterable directory holding a
    root-only file, a directory anyone may write (only Landlock stands in the way) and one only
    its owner may."""
    top = Path(tempfile.mkdtemp(prefix="kiln-sandbox-user-"))
    top.chmod(0o755)
    secret = top / "signing.key"
    secret.write_text(SECRET)
    secret.chmod(0o600)
    open_dir = top / "anyone"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    owner_dir = top / "owner"
    owner_dir.mkdir()
    owner_dir.chmod(0o755)
    try:
        yield {"secret": secret, "open": open_dir, "owner": owner_dir}
    finally:
        shutil.rmtree(top, ignore_errors=True)


@pytest.fixture(scope="module")
def engine(places: dict[str, Path]) -> Iterator[Engine]:
    saved = {k: os.environ.get(k) for k in ("KILN_DATABASE_URL", "AWS_SECRET_ACCESS_KEY")}
    os.environ["KILN_DATABASE_URL"] = f"postgresql+psycopg://kiln:{SECRET}@db:5432/kiln"
    os.environ["AWS_SECRET_ACCESS_KEY"] = SECRET
    spec = EngineSpec.from_workload(tiny_workload(), "fast", LIMITS)
    engine = Engine(spec, engine_id="sandbox-user")
    try:
        yield engine
    finally:
        engine.close()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _probe(places: dict[str, Path], port: int) -> Candidate:
    """A code module that tries everything at load and writes what it saw to $HOME/probe.json
    (registering nothing: the reference forward then runs in the sandbox)."""
    source = textwrap.dedent(
        f"""
        import json, socket
        from pathlib import Path

        seen = {{}}
        def attempt(name, fn):
            try:
                seen[name] = "done: " + repr(fn())[:200]
            except Exception as exc:
                seen[name] = "refused: " + type(exc).__name__ + ": " + str(exc)[:200]

        attempt("read_root_only", lambda: Path({str(places["secret"])!r}).read_text())
        attempt("write_open_dir", lambda: Path({str(places["open"])!r}, "x").write_text("x"))
        attempt("write_owner_dir", lambda: Path({str(places["owner"])!r}, "x").write_text("x"))
        attempt("write_tmp", lambda: Path("/tmp", "kiln-sandbox-escape-{port}").write_text("x"))
        def connect():
            with socket.create_connection(("127.0.0.1", {port}), timeout=2) as s:
                s.sendall(b"hello")
        attempt("connect", connect)
        attempt("udp", lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(
            b"x", ("127.0.0.1", {port})))
        attempt("setuid_root", lambda: os.setuid(0))
        judge = os.getppid()
        for path in ("/proc/self/environ", f"/proc/{{judge}}/environ", "/proc/1/environ",
                     f"/proc/{{judge}}/mem"):
            attempt("read " + path, lambda: Path(path).read_bytes()[:4096].decode("latin-1"))
        seen["environ"] = dict(os.environ)
        Path(os.environ["HOME"], "probe.json").write_text(json.dumps(seen, indent=1))
        """
    )
    return Candidate.make(code_modules=[module("probe", source)])


def _run(engine: Engine, candidate: Candidate) -> Measurement:
    return engine.run(RunRequest("probe", candidate, warmup=1, repeats=2, seed=3))


def test_the_sandbox_is_unprivileged_and_its_candidate_reaches_nothing(
    engine: Engine, places: dict[str, Path]
) -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        m = _run(engine, _probe(places, port))
        assert m.status == "ok", m.error
        host = engine._sandbox
        assert host is not None
        ids = _ids(host.pid)
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing connected
    report_file = Path(host.home, "probe.json")
    report = json.loads(report_file.read_text())
    text = report_file.read_text()
    assert SECRET not in text  # not in its environment, not in any file it could read
    assert not [k for k in report["environ"] if k.startswith(("KILN_", "AWS_"))]
    for name in ("write_open_dir", "write_owner_dir", "write_tmp", "connect", "udp"):
        assert report[name].startswith("refused"), (name, report[name])
    assert not (places["open"] / "x").exists() and not (places["owner"] / "x").exists()
    assert not Path(f"/tmp/kiln-sandbox-escape-{port}").exists()
    judge_env = [k for k in report if k.startswith("read /proc/") and "self" not in k]
    assert judge_env and all(report[k].startswith("refused") for k in judge_env), report
    if not ROOT:
        uid = os.getuid()
        assert ids["Uid"] == [uid] * 4
        assert any("the engine runs as uid" in n for n in m.notes), m.notes
        return
    assert ids["Uid"] == [NOBODY] * 4 and ids["Gid"] == [NOBODY] * 4 and ids["Groups"] == []
    assert report["read_root_only"].startswith("refused: PermissionError"), report
    assert report["setuid_root"].startswith("refused"), report  # EINVAL: no uid 0 in its userns
    assert os.stat(host.home).st_uid == NOBODY
    assert not any("unprivileged user" in n for n in m.notes), m.notes
    # the sandbox still measures an honest code module as that user
    honest = Candidate.make({"mlp": "handwritten"}, code_modules=[HANDWRITTEN_MLP])
    assert _run(engine, honest).status == "ok"


@needs_root
def test_a_configured_uid_and_gid(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_SANDBOX_UID", "4242")
    monkeypatch.setenv("KILN_SANDBOX_GID", "4343")
    spec = EngineSpec.from_workload(tiny_workload(), "fast", LIMITS)
    engine = Engine(spec, engine_id="sandbox-uid")
    try:
        m = _run(engine, Candidate.make({"mlp": "handwritten"}, code_modules=[HANDWRITTEN_MLP]))
        assert m.status == "ok", m.error
        assert engine._sandbox is not None
        ids = _ids(engine._sandbox.pid)
        assert ids["Uid"] == [4242] * 4 and ids["Gid"] == [4343] * 4 and ids["Groups"] == []
    finally:
        engine.close()


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"KILN_SANDBOX_UID": "0"}, "0 would be root"),
        ({"KILN_SANDBOX_UID": "nobody"}, "is not a number"),
        ({"KILN_SANDBOX_UID": "10", "KILN_SANDBOX_GID": "-1"}, "KILN_SANDBOX_GID=-1 is out"),
    ],
)
def test_a_bad_configured_user_says_which_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        configured_user(env)


def test_the_default_user_is_nobody() -> None:
    user = configured_user({})
    assert user.uid == NOBODY and user.gid == NOBODY


VIEW = """
import json, os, sys
from kiln.runtime.sandbox.user import SandboxUser, _become, unreachable
from kiln.runtime.sandbox.view import cover

top, needed = sys.argv[1], sys.argv[2]
user = SandboxUser(65534, 65534)
before = unreachable(user, [needed])
refused = cover(before)
after = unreachable(user, [needed])
_become(user)
print(json.dumps({"before": before, "refused": refused, "after": after,
                  "listing": sorted(os.listdir(top)), "lib": sorted(os.listdir(needed))}))
"""


@needs_root
def test_a_view_makes_a_needed_path_under_a_closed_directory_reachable(tmp_path: Path) -> None:
    """A directory its user may not enter (0700, like /root above a pyenv Python) is covered in
    the sandbox's own mount namespace: the needed path under it is there, nothing else is."""
    top = Path(tempfile.mkdtemp(prefix="kiln-view-"))  # 0700, root's
    try:
        lib = top / "pyenv" / "lib"
        lib.mkdir(parents=True)
        (lib / "os.py").write_text("")
        (top / "pyenv").chmod(0o755)
        lib.chmod(0o755)
        (top / "ca.key").write_text("secret")
        done = subprocess.run(
            [sys.executable, "-c", VIEW, str(top), str(lib)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        seen = json.loads(done.stdout)
        assert seen["before"] == {str(lib): str(top)}
        assert seen["refused"] == "" and seen["after"] == {}
        assert seen["listing"] == ["pyenv"] and seen["lib"] == ["os.py"]  # no ca.key there
        assert sorted(os.listdir(top)) == ["ca.key", "pyenv"]  # the host's view is unchanged
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_the_engine_pool_refuses_a_bad_sandbox_user_at_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``kiln serve engine-pool`` reads its settings first: a bad value stops it there, not as
    crashed candidates later."""
    from pydantic import ValidationError

    from kiln.engine_pool.settings import EngineSettings

    monkeypatch.setenv("KILN_SANDBOX_UID", "0")
    with pytest.raises(ValidationError, match="KILN_SANDBOX_UID=0 is out of range"):
        EngineSettings()
    monkeypatch.setenv("KILN_SANDBOX_UID", "1234")
    assert EngineSettings().sandbox_uid == "1234"
