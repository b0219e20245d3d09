"""The export artifact: a directory holding what is needed to rebuild and re-time a compilation's
winner outside kiln's services. Imports no torch.

Layout::

    manifest.json        Manifest
    candidate.json       the candidate's canonical JSON (what loads)
    model_config.json    the model's config.json
    code/NN_NAME.py      each code module's source, for reading
    signature.json       the deployment's signature of all of the above (kiln.export.signing)

:func:`read_artifact` raises :class:`ArtifactError` naming what is wrong; it reads the files
without checking a signature (``kiln.export.signing.verify_artifact`` does, and
:func:`parse_artifact` then reads the very bytes it verified).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kiln.domain.candidate import Candidate
from kiln.domain.operating_point import OperatingPoint

SCHEMA_VERSION: Literal[1] = 1
MANIFEST = "manifest.json"
CANDIDATE = "candidate.json"
MODEL_CONFIG = "model_config.json"
CODE_DIR = "code"
CONTENT_FILES = (MANIFEST, CANDIDATE, MODEL_CONFIG)
"""The files every artifact holds and :func:`parse_artifact` reads (code modules are inside
``candidate.json``; ``code/`` copies them for reading)."""
_UNSAFE = re.compile(r"[^A-Za-z0-9_]")


class ArtifactError(ValueError):
    """An artifact directory that cannot be used; the message names the file and the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class WeightsSource(_Strict):
    """Where the weights come from: ``seeded_random`` (``seed``) or ``safetensors`` (``path``)."""

    kind: Literal["seeded_random", "safetensors"]
    seed: int = Field(default=0, ge=0)
    path: str | None = None


class MeasuredAt(_Strict):
    """``manifest.operating_point``: the operating point measured at and the engine's extent
    (``layers`` of ``total_layers``, ``dtype``, ``device`` type, ``expert_zipf_exponent``).
    """

    batch_size: int = Field(ge=1)
    context_len: int = Field(ge=1)
    layers: int = Field(ge=1)
    total_layers: int = Field(ge=1)
    dtype: Literal["float32", "bfloat16", "float16"]
    device: str = Field(min_length=1)
    expert_zipf_exponent: float = Field(default=0.0, ge=0)

    @classmethod
    def from_point(cls, point: OperatingPoint, **extent: Any) -> MeasuredAt:
        """``point``'s batch and context with the engine's ``extent``; ValidationError on a bad
        field.
        """
        return cls(batch_size=point.batch_size, context_len=point.context_len, **extent)


class Measured(_Strict):
    """The figures the engine recorded: tokens/s, median, p10 and p90 step (ms), tier, hardware,
    engine and experiment.
    """

    tokens_per_s: float = Field(gt=0)
    median_ms: float = Field(gt=0)
    p10_ms: float = Field(default=0.0, ge=0)
    p90_ms: float = Field(default=0.0, ge=0)
    max_abs_error: float = Field(default=0.0, ge=0)
    tier: Literal["fast", "full"]
    hardware: str = ""
    engine_id: str = ""
    compilation_id: str = ""
    experiment_id: str = ""
    speedup: float = Field(default=0.0, ge=0)


class Manifest(_Strict):
    """``manifest.json`` (schema version :data:`SCHEMA_VERSION`)."""

    schema_version: Literal[1] = SCHEMA_VERSION
    model_name: str = Field(min_length=1)
    candidate_id: str = Field(min_length=1)
    lossy: bool = False
    operating_point: MeasuredAt
    weights: WeightsSource
    measured: Measured
    environment: dict[str, str] = Field(default_factory=dict)
    code_module_files: list[str] = Field(default_factory=list)


@dataclass(frozen=True)
class Artifact:
    """An artifact read back: its manifest, candidate and model config (a JSON object)."""

    path: Path
    manifest: Manifest
    candidate: Candidate
    model_config: dict[str, Any]


def _errors(file: str, exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:6]:
        where = ".".join(str(x) for x in err["loc"]) or "(top level)"
        parts.append(f"{where}: {err['msg']}")
    return f"{file}: " + "; ".join(parts)


def _json(name: str, data: bytes) -> Any:
    try:
        return json.loads(data.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{name} is not valid JSON: {exc}") from None


def artifact_root(path: str | Path) -> Path:
    """``path`` as an artifact directory; ArtifactError if it is not a directory."""
    root = Path(path)
    if not root.is_dir():
        raise ArtifactError(f"{root} is not an artifact directory")
    return root


def read_files(root: Path) -> dict[str, bytes]:
    """The bytes of :data:`CONTENT_FILES`; ArtifactError naming one that is missing."""
    files = {}
    for name in CONTENT_FILES:
        path = root / name
        if not path.is_file():
            raise ArtifactError(f"{name} is missing in {root}")
        files[name] = path.read_bytes()
    return files


def check_out_dir(out_dir: str | Path) -> Path:
    """``out_dir`` as a path; ArtifactError if it exists and is not an empty directory."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ArtifactError(f"{out} exists and is not an empty directory")
    return out


def write_artifact(
    out_dir: str | Path,
    manifest: Manifest,
    candidate: Candidate,
    model_config: dict[str, Any],
) -> Path:
    """Write the artifact into ``out_dir``; ArtifactError if it is not new or empty, or the
    candidate's id is not ``manifest.candidate_id``.
    """
    out = check_out_dir(out_dir)
    if candidate.id != manifest.candidate_id:
        raise ArtifactError(
            f"the candidate's id {candidate.id} differs from the manifest's {manifest.candidate_id}"
        )
    files = []
    code = out / CODE_DIR
    for i, module in enumerate(candidate.code_modules):
        name = f"{CODE_DIR}/{i:02d}_{_UNSAFE.sub('_', module.name)}.py"
        files.append(name)
    manifest = manifest.model_copy(update={"code_module_files": files})
    out.mkdir(parents=True, exist_ok=True)
    if candidate.code_modules:
        code.mkdir()
    for name, module in zip(files, candidate.code_modules, strict=True):
        (out / name).write_text(module.source, encoding="utf-8")
    (out / CANDIDATE).write_text(json.dumps(candidate.canonical(), indent=2) + "\n")
    (out / MODEL_CONFIG).write_text(json.dumps(model_config, indent=2) + "\n")
    (out / MANIFEST).write_text(manifest.model_dump_json(indent=2) + "\n")
    return out


def read_artifact(path: str | Path) -> Artifact:
    """Read and check an artifact directory (its signature unchecked); ArtifactError naming the
    file and field for anything missing, malformed, unsupported or mismatched.
    """
    root = artifact_root(path)
    return parse_artifact(root, read_files(root))


def parse_artifact(root: Path, files: dict[str, bytes]) -> Artifact:
    """The artifact from the bytes of its :data:`CONTENT_FILES` (``files``, as read once);
    ArtifactError as :func:`read_artifact`.
    """
    raw = _json(MANIFEST, files[MANIFEST])
    if not isinstance(raw, dict):
        raise ArtifactError(f"{MANIFEST}: expected a JSON object, got {type(raw).__name__}")
    version = raw.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ArtifactError(
            f"{MANIFEST}: schema_version {version!r} is not supported (this kiln reads "
            f"{SCHEMA_VERSION})"
        )
    try:
        manifest = Manifest.model_validate(raw)
    except ValidationError as exc:
        raise ArtifactError(_errors(MANIFEST, exc)) from None
    body = _json(CANDIDATE, files[CANDIDATE])
    try:
        candidate = Candidate.from_canonical(body)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ArtifactError(f"{CANDIDATE}: not a candidate ({exc!r})") from None
    if candidate.id != manifest.candidate_id:
        raise ArtifactError(
            f"{CANDIDATE}: its content id {candidate.id} differs from the manifest's "
            f"candidate_id {manifest.candidate_id} (edited by hand?)"
        )
    config = _json(MODEL_CONFIG, files[MODEL_CONFIG])
    if not isinstance(config, dict):
        raise ArtifactError(f"{MODEL_CONFIG}: expected a JSON object")
    return Artifact(root, manifest, candidate, config)
