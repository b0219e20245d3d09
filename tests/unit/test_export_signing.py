"""Signed artifacts: the deployment key created once (0600, its public key beside it), a
sign/verify round trip through ``load_optimized``, and every tamper refused with its own error
before any code module runs: a byte of a code module (in ``candidate.json``, which is what
loads, and in the readable ``code/`` copy), the candidate's ops, the workload's operating point,
the measurements, the model config, the signature, the key id, a removed signature, an unknown
key, a file added to ``code/``. Old unsigned artifacts load with ``verify=False``. The default
trusted keys: the state directory's ``signing.pub`` and ``KILN_TRUSTED_KEYS``."""

from __future__ import annotations

import base64
import json
import os
import re
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

import kiln
import kiln.export
from kiln.domain.candidate import Candidate, CodeModule
from kiln.export.artifact import CANDIDATE, MANIFEST, MODEL_CONFIG, write_artifact
from kiln.export.signing import (
    SIGNATURE,
    AlteredArtifact,
    SignatureError,
    SigningKeyError,
    UnknownSigningKey,
    UnsignedArtifact,
    default_trusted_keys,
    deployment_key,
    key_id,
    public_pem,
    sign_artifact,
    verify_artifact,
)
from tests.unit.engine_testing import TINY_LLAMA, module

from .test_export import _manifest

# Leaves a mark in this process when its code runs: a refused artifact must never get that far.
MARKED = module(
    "marked",
    """
import builtins
builtins.KILN_SIGNING_TEST_RAN = True

@register("mlp", "marked", replace=True)
def marked(x, *, gate_weight, up_weight, down_weight):
    import torch.nn.functional as F
    return F.linear(F.silu(F.linear(x, gate_weight)) * F.linear(x, up_weight), down_weight)
""",
)
CANDIDATE_WITH_CODE = Candidate.make({"mlp": "marked"}, code_modules=[MARKED])

REPO = str(Path(__file__).parents[2])


@pytest.fixture
def key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


@pytest.fixture(autouse=True)
def _no_mark() -> None:
    import builtins

    if hasattr(builtins, "KILN_SIGNING_TEST_RAN"):
        del builtins.KILN_SIGNING_TEST_RAN


def _ran() -> bool:
    import builtins

    return bool(getattr(builtins, "KILN_SIGNING_TEST_RAN", False))


def _signed(tmp_path: Path, key: Ed25519PrivateKey) -> Path:
    path = write_artifact(
        tmp_path / "art", _manifest(CANDIDATE_WITH_CODE), CANDIDATE_WITH_CODE, TINY_LLAMA
    )
    sign_artifact(path, key)
    return path


def _trusted(key: Ed25519PrivateKey) -> dict[str, object]:
    return {key_id(key.public_key()): key.public_key()}


def test_the_deployment_key_is_made_once_private_with_its_public_key_beside(
    tmp_path: Path,
) -> None:
    first = deployment_key(tmp_path / "state")
    pki = tmp_path / "state" / "pki"
    assert stat.S_IMODE((pki / "signing.key").stat().st_mode) == 0o600
    assert (pki / "signing.pub").read_bytes() == public_pem(first.public_key())
    again = deployment_key(tmp_path / "state")
    assert key_id(again.public_key()) == key_id(first.public_key())
    assert list(default_trusted_keys(tmp_path / "state", environ={})) == [
        key_id(first.public_key())
    ]
    (pki / "signing.key").chmod(0o644)
    with pytest.raises(SigningKeyError, match="readable or writable by others"):
        deployment_key(tmp_path / "state")


def test_sign_and_verify_round_trip(tmp_path: Path, key: Ed25519PrivateKey) -> None:
    path = _signed(tmp_path, key)
    doc = json.loads((path / SIGNATURE).read_text())
    assert doc["key_id"] == key_id(key.public_key())
    assert sorted(doc["files"]) == sorted([CANDIDATE, MANIFEST, MODEL_CONFIG, "code/00_marked.py"])
    files = verify_artifact(path, _trusted(key))  # type: ignore[arg-type]
    assert files[CANDIDATE] == (path / CANDIDATE).read_bytes()
    opt = kiln.load_optimized(path, trusted_keys=_trusted(key))  # type: ignore[arg-type]
    try:
        assert _ran() and opt.model.binding.recipe["mlp"] == "marked"
    finally:
        opt.release()


def _edit_json(name: str, change: Callable[[dict], None]) -> Callable[[Path], None]:  # type: ignore[type-arg]
    def edit(path: Path) -> None:
        raw = json.loads((path / name).read_text())
        change(raw)
        (path / name).write_text(json.dumps(raw, indent=2) + "\n")

    return edit


def _flip_byte(name: str, needle: bytes) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        data = (path / name).read_bytes()
        at = data.index(needle)
        (path / name).write_bytes(data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1 :])

    return edit


def _code_source(raw: dict) -> None:  # type: ignore[type-arg]
    raw["code_modules"][0]["source"] += "\nimport os; os.system('true')\n"


def _new_signature(raw: dict) -> None:  # type: ignore[type-arg]
    sig = bytearray(base64.b64decode(raw["signature"]))
    sig[0] ^= 0x01
    raw["signature"] = base64.b64encode(bytes(sig)).decode()


def _other_key_id(raw: dict) -> None:  # type: ignore[type-arg]
    raw["key_id"] = "0" * 64


def _drop_from_list(raw: dict) -> None:  # type: ignore[type-arg]
    raw["files"].pop("code/00_marked.py")


TAMPERS = {
    # what loads: the module's source inside candidate.json (one byte of "builtins")
    "a byte of a code module": (_flip_byte(CANDIDATE, b"builtins"), AlteredArtifact, CANDIDATE),
    "a byte of the readable code copy": (
        _flip_byte("code/00_marked.py", b"builtins"),
        AlteredArtifact,
        "code/00_marked.py was altered",
    ),
    "the candidate's ops": (
        _edit_json(CANDIDATE, lambda c: c["ops"].update(attention="zeros")),
        AlteredArtifact,
        f"{CANDIDATE} was altered",
    ),
    "a code module's source rewritten": (
        _edit_json(CANDIDATE, _code_source),
        AlteredArtifact,
        f"{CANDIDATE} was altered",
    ),
    "the workload's operating point": (
        _edit_json(MANIFEST, lambda m: m["operating_point"].update(batch_size=4)),
        AlteredArtifact,
        f"{MANIFEST} was altered",
    ),
    "the measurements": (
        _edit_json(MANIFEST, lambda m: m["measured"].update(tokens_per_s=99999.0)),
        AlteredArtifact,
        f"{MANIFEST} was altered",
    ),
    "the model config": (
        _edit_json(MODEL_CONFIG, lambda c: c.update(num_hidden_layers=1)),
        AlteredArtifact,
        f"{MODEL_CONFIG} was altered",
    ),
    "the signature": (_edit_json(SIGNATURE, _new_signature), AlteredArtifact, "does not verify"),
    "the list of signed files": (
        _edit_json(SIGNATURE, _drop_from_list),
        AlteredArtifact,
        "does not verify",
    ),
    "the key id": (_edit_json(SIGNATURE, _other_key_id), UnknownSigningKey, "not trusted here"),
    "a removed signature": (lambda p: (p / SIGNATURE).unlink(), UnsignedArtifact, "is not signed"),
    "a file added to code/": (
        lambda p: (p / "code" / "01_extra.py").write_text("print('hi')\n"),
        AlteredArtifact,
        "code/01_extra.py is not signed",
    ),
    "a signed file removed": (
        lambda p: (p / "code" / "00_marked.py").unlink(),
        AlteredArtifact,
        "code/00_marked.py is signed but missing",
    ),
}


@pytest.mark.parametrize("tamper", list(TAMPERS))
def test_every_tamper_is_refused_before_any_code_runs(
    tmp_path: Path, key: Ed25519PrivateKey, tamper: str
) -> None:
    edit, error, message = TAMPERS[tamper]
    path = _signed(tmp_path, key)
    edit(path)
    with pytest.raises(error, match=re.escape(message)) as raised:
        kiln.load_optimized(path, trusted_keys=_trusted(key))  # type: ignore[arg-type]
    assert isinstance(raised.value, SignatureError)
    assert not _ran()


def test_a_key_that_is_not_trusted_is_refused(tmp_path: Path, key: Ed25519PrivateKey) -> None:
    path = _signed(tmp_path, key)
    other = Ed25519PrivateKey.generate()
    with pytest.raises(kiln.export.UnknownSigningKey, match=key_id(key.public_key())[:16]):
        kiln.load_optimized(path, trusted_keys=_trusted(other))  # type: ignore[arg-type]
    # re-signed by the other key: the signature names the other key, which is not trusted
    (path / SIGNATURE).unlink()
    sign_artifact(path, other)
    with pytest.raises(UnknownSigningKey):
        kiln.load_optimized(path, trusted_keys=_trusted(key))  # type: ignore[arg-type]
    assert not _ran()


def test_an_unsigned_artifact_loads_only_with_verify_false(tmp_path: Path) -> None:
    path = write_artifact(
        tmp_path / "old", _manifest(CANDIDATE_WITH_CODE), CANDIDATE_WITH_CODE, TINY_LLAMA
    )
    with pytest.raises(UnsignedArtifact, match="verify=False"):
        kiln.load_optimized(path, trusted_keys={})
    assert not _ran()
    opt = kiln.load_optimized(path, verify=False)
    try:
        assert _ran()
    finally:
        opt.release()


def test_default_trusted_keys_come_from_the_state_dir_and_kiln_trusted_keys(
    tmp_path: Path, key: Ed25519PrivateKey, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _signed(tmp_path, key)
    state = tmp_path / "state"
    monkeypatch.setenv("KILN_STATE_DIR", str(state))
    monkeypatch.delenv("KILN_TRUSTED_KEYS", raising=False)
    with pytest.raises(UnknownSigningKey, match="trusted: none"):
        kiln.load_optimized(path)
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / "deploy.pub").write_bytes(public_pem(key.public_key()))
    monkeypatch.setenv("KILN_TRUSTED_KEYS", str(keys))  # a directory of *.pub
    kiln.load_optimized(path).release()
    kiln.load_optimized(path, trusted_keys=str(keys / "deploy.pub")).release()  # one path
    monkeypatch.setenv("KILN_TRUSTED_KEYS", str(tmp_path / "missing.pub"))
    with pytest.raises(SignatureError, match=r"missing\.pub"):
        kiln.load_optimized(path)
    monkeypatch.delenv("KILN_TRUSTED_KEYS")
    own = deployment_key(state)  # this state directory's own key is trusted by default
    (path / SIGNATURE).unlink()
    sign_artifact(path, own)
    kiln.load_optimized(path).release()


def test_reproduce_refuses_a_tampered_artifact(tmp_path: Path, key: Ed25519PrivateKey) -> None:
    path = _signed(tmp_path, key)
    pub = tmp_path / "trusted.pub"
    pub.write_bytes(public_pem(key.public_key()))
    _flip_byte(CANDIDATE, b"builtins")(path)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]
        ),
        "KILN_STATE_DIR": str(tmp_path / "state"),
    }
    done = subprocess.run(
        [sys.executable, "-m", "kiln.export.reproduce", str(path), "--trusted-key", str(pub)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"{CANDIDATE} was altered after signing" in done.stderr


def test_a_module_copy_matches_what_loads(tmp_path: Path, key: Ed25519PrivateKey) -> None:
    """The readable copy under code/ is the source that loads (both signed)."""
    path = _signed(tmp_path, key)
    files = verify_artifact(path, _trusted(key))  # type: ignore[arg-type]
    source = json.loads(files[CANDIDATE])["code_modules"][0]["source"]
    assert files["code/00_marked.py"].decode() == source
    assert CodeModule("marked", source) == MARKED
