"""Signed artifacts (rationale: docs/design/security.md, "Candidate code and artifacts").

An artifact's *signed content* is the bytes of every file ``load_optimized`` and ``reproduce``
act on: ``manifest.json`` (operating point, weights source, measurements, environment),
``candidate.json`` (ops, transforms, code modules' source, lossy), ``model_config.json``, and
every file under ``code/`` (the modules' readable copies). ``signature.json`` holds::

    {"format": "kiln-artifact-signature/1", "algorithm": "ed25519", "key_id": KEY_ID,
     "files": {NAME: SHA-256 hex of its bytes, ...}, "signature": base64 Ed25519 signature}

The signature is over the canonical JSON (sorted keys, no spaces, ASCII) of the object without
``signature``, so the key id and the file list are signed too. ``KEY_ID`` is the SHA-256 hex of
the raw 32-byte public key. Not signed: the weights (a ``safetensors`` path in the manifest is
signed, what lies there is the loader's own), and files outside ``code/`` that the list does not
name (nothing reads them).

The deployment's key is ``KILN_STATE_DIR/pki/signing.key`` (PKCS#8 PEM, mode 0600), created once
by :func:`deployment_key`, with ``signing.pub`` (SubjectPublicKeyInfo PEM) beside it. Trusted
keys by default (:func:`default_trusted_keys`): that ``signing.pub`` when present, plus every
entry of ``KILN_TRUSTED_KEYS`` (paths separated by ``os.pathsep``; a file holds one or more PEM
public keys, a directory stands for its ``*.pub`` files).

:func:`verify_artifact` raises one :class:`SignatureError` subclass per failure:
:class:`UnsignedArtifact`, :class:`UnknownSigningKey`, :class:`AlteredArtifact`.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import re
import secrets
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from kiln.export.artifact import CODE_DIR, CONTENT_FILES, ArtifactError

SIGNATURE = "signature.json"
FORMAT = "kiln-artifact-signature/1"
ALGORITHM = "ed25519"
PKI_DIR = "pki"
KEY_FILE = "signing.key"
PUB_FILE = "signing.pub"
TRUSTED_KEYS_ENV = "KILN_TRUSTED_KEYS"
_CODE_FILE = re.compile(rf"^{CODE_DIR}/[A-Za-z0-9_]+\.py$")
_PEM_PUBLIC = re.compile(rb"-----BEGIN PUBLIC KEY-----\s.*?-----END PUBLIC KEY-----", re.DOTALL)

TrustedKeys = Mapping[str, Ed25519PublicKey]
"""Key id -> public key."""


class SignatureError(ArtifactError):
    """The artifact's signature does not let it load (``verify=False`` skips the check)."""


class UnsignedArtifact(SignatureError):
    """The artifact has no ``signature.json``."""


class UnknownSigningKey(SignatureError):
    """The artifact is signed by a key that is not among the trusted keys."""


class AlteredArtifact(SignatureError):
    """The artifact's content or signature changed after signing (or was never signed right)."""


class SigningKeyError(ValueError):
    """The deployment's signing key cannot be created or used; the message says why."""


def key_id(public: Ed25519PublicKey) -> str:
    """SHA-256 hex of the raw 32-byte public key."""
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()


def public_pem(public: Ed25519PublicKey) -> bytes:
    """``public`` as a SubjectPublicKeyInfo PEM block."""
    return public.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def _write_new(path: Path, data: bytes, mode: int) -> None:
    """Write ``path`` once, atomically: a private temporary file linked into place (a file that
    another process linked first wins; ours is dropped)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
    finally:
        tmp.unlink(missing_ok=True)


def deployment_key(state_dir: str | Path) -> Ed25519PrivateKey:
    """The deployment's signing key under ``state_dir/pki/``, created (0600, its ``signing.pub``
    beside it) the first time.

    Raises:
        SigningKeyError: the key file is readable by others, or is not an Ed25519 PEM key.
    """
    pki = Path(state_dir).expanduser() / PKI_DIR
    pki.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = pki / KEY_FILE
    if not path.exists():
        pem = Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        _write_new(path, pem, 0o600)
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise SigningKeyError(
            f"{path} is readable or writable by others (mode {mode:04o}): chmod 600 it"
        )
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (ValueError, TypeError) as exc:
        raise SigningKeyError(f"{path} is not a PEM private key: {exc}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise SigningKeyError(f"{path} is not an Ed25519 key ({type(key).__name__})")
    pub = pki / PUB_FILE
    want = public_pem(key.public_key())
    if not pub.exists() or pub.read_bytes() != want:
        pub.unlink(missing_ok=True)  # derived from the key: rewritten when it differs
        _write_new(pub, want, 0o644)
    return key


def load_public_keys(paths: Iterable[str | Path]) -> dict[str, Ed25519PublicKey]:
    """The Ed25519 public keys in ``paths`` (files of PEM blocks; a directory: its ``*.pub``).

    Raises:
        SignatureError: a path that does not exist or holds no Ed25519 public key.
    """
    keys: dict[str, Ed25519PublicKey] = {}
    for entry in paths:
        path = Path(entry).expanduser()
        files = sorted(path.glob("*.pub")) if path.is_dir() else [path]
        for file in files:
            try:
                blocks = _PEM_PUBLIC.findall(file.read_bytes())
            except OSError as exc:
                raise SignatureError(f"trusted key {file}: {exc.strerror}") from None
            found = 0
            for block in blocks:
                try:
                    public = serialization.load_pem_public_key(block)
                except ValueError:
                    continue
                if isinstance(public, Ed25519PublicKey):
                    keys[key_id(public)] = public
                    found += 1
            if not found:
                raise SignatureError(f"trusted key {file}: no Ed25519 public key (PEM) in it")
    return keys


def default_trusted_keys(
    state_dir: str | Path | None = None, environ: Mapping[str, str] | None = None
) -> dict[str, Ed25519PublicKey]:
    """``state_dir/pki/signing.pub`` (default ``KILN_STATE_DIR``, else ``~/.kiln``) when it
    exists, plus the entries of ``KILN_TRUSTED_KEYS`` (module docstring)."""
    env = os.environ if environ is None else environ
    if state_dir is None:
        from kiln.common.settings import KilnSettings

        state_dir = env.get("KILN_STATE_DIR") or KilnSettings.model_fields["state_dir"].default
    paths: list[str | Path] = []
    own = Path(state_dir).expanduser() / PKI_DIR / PUB_FILE
    if own.is_file():
        paths.append(own)
    paths += [p for p in env.get(TRUSTED_KEYS_ENV, "").split(os.pathsep) if p]
    return load_public_keys(paths)


def _canonical(obj: Mapping[str, Any]) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _signed_names(root: Path) -> list[str]:
    """The files an artifact's signature covers, as they are in ``root`` now."""
    names = [n for n in CONTENT_FILES if (root / n).is_file()]
    code = root / CODE_DIR
    if code.is_dir():
        names += sorted(f"{CODE_DIR}/{p.name}" for p in code.iterdir())
    return names


def sign_artifact(root: str | Path, key: Ed25519PrivateKey) -> str:
    """Write ``root/signature.json`` over the artifact's content as it is now; returns the key
    id. ArtifactError if the artifact is already signed or a content file is missing."""
    root = Path(root)
    if (root / SIGNATURE).exists():
        raise ArtifactError(f"{root} is already signed ({SIGNATURE} exists)")
    for name in CONTENT_FILES:
        if not (root / name).is_file():
            raise ArtifactError(f"{name} is missing in {root}")
    files = {n: hashlib.sha256((root / n).read_bytes()).hexdigest() for n in _signed_names(root)}
    kid = key_id(key.public_key())
    body = {"format": FORMAT, "algorithm": ALGORITHM, "key_id": kid, "files": files}
    signature = base64.b64encode(key.sign(_canonical(body))).decode()
    (root / SIGNATURE).write_text(json.dumps({**body, "signature": signature}, indent=2) + "\n")
    return kid


def _read_signature(root: Path) -> dict[str, Any]:
    path = root / SIGNATURE
    if not path.is_file():
        raise UnsignedArtifact(
            f"{root} is not signed (no {SIGNATURE}); kiln export signs every artifact. Load it "
            "with verify=False only if you trust where it came from"
        )
    try:
        doc = json.loads(path.read_bytes().decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AlteredArtifact(f"{SIGNATURE} is not valid JSON: {exc}") from None
    if not isinstance(doc, dict) or set(doc) != {
        "format",
        "algorithm",
        "key_id",
        "files",
        "signature",
    }:
        raise AlteredArtifact(f"{SIGNATURE}: not a kiln artifact signature")
    if doc["format"] != FORMAT or doc["algorithm"] != ALGORITHM:
        raise AlteredArtifact(
            f"{SIGNATURE}: format {doc['format']!r} / algorithm {doc['algorithm']!r} is not "
            f"{FORMAT} / {ALGORITHM}"
        )
    files = doc["files"]
    if not isinstance(files, dict) or not all(
        isinstance(n, str) and isinstance(d, str) for n, d in files.items()
    ):
        raise AlteredArtifact(f"{SIGNATURE}: files is not a name -> digest object")
    if not isinstance(doc["key_id"], str) or not isinstance(doc["signature"], str):
        raise AlteredArtifact(f"{SIGNATURE}: key_id and signature must be strings")
    return doc


def verify_artifact(root: str | Path, trusted: TrustedKeys) -> dict[str, bytes]:
    """Check ``root``'s signature against ``trusted``; returns the bytes of every signed file,
    read once (parse these, not the files again).

    Raises:
        UnsignedArtifact: no ``signature.json``.
        UnknownSigningKey: signed by a key not in ``trusted``.
        AlteredArtifact: the signature does not verify, a signed file is missing or differs, a
            content file is not covered, or ``code/`` holds a file the signature does not name.
    """
    root = Path(root)
    doc = _read_signature(root)
    kid = doc["key_id"]
    public = trusted.get(kid)
    if public is None:
        known = ", ".join(k[:16] for k in sorted(trusted)) or "none"
        raise UnknownSigningKey(
            f"{root} is signed by key {kid[:16]}..., which is not trusted here (trusted: "
            f"{known}; from KILN_STATE_DIR/{PKI_DIR}/{PUB_FILE}, {TRUSTED_KEYS_ENV} or "
            "trusted_keys)"
        )
    try:
        signature = base64.b64decode(doc["signature"], validate=True)
        body = {k: v for k, v in doc.items() if k != "signature"}
        public.verify(signature, _canonical(body))
    except (InvalidSignature, binascii.Error, ValueError):
        raise AlteredArtifact(
            f"{root}: {SIGNATURE} does not verify with key {kid[:16]}... (the signature or the "
            "list of files it covers changed after signing)"
        ) from None
    files: dict[str, str] = doc["files"]
    for name in CONTENT_FILES:
        if name not in files:
            raise AlteredArtifact(f"{root}: the signature does not cover {name}")
    for name in _signed_names(root):
        if name not in files:
            raise AlteredArtifact(f"{root}: {name} is not signed (added after signing?)")
    content: dict[str, bytes] = {}
    for name, digest in sorted(files.items()):
        if name not in CONTENT_FILES and not _CODE_FILE.match(name):
            raise AlteredArtifact(f"{SIGNATURE}: {name!r} is not an artifact file")
        path = root / name
        if not path.is_file():
            raise AlteredArtifact(f"{root}: {name} is signed but missing")
        data = path.read_bytes()
        if hashlib.sha256(data).hexdigest() != digest:
            raise AlteredArtifact(f"{root}: {name} was altered after signing")
        content[name] = data
    return content
