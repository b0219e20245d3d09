"""The export artifact (manifest round trip, bad manifests), ``load_optimized`` on CPU against
the reference forward, and ``python -m kiln.export.reproduce`` in a fresh process. Artifacts are
signed with a key of this module's (the signature checks: ``test_export_signing``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kiln.domain.candidate import Candidate, Transform
from kiln.export.artifact import (
    MANIFEST,
    ArtifactError,
    Manifest,
    Measured,
    MeasuredAt,
    WeightsSource,
    read_artifact,
    write_artifact,
)
from kiln.export.load import OptimizedModel, VersionWarning, load_optimized
from kiln.export.signing import key_id, public_pem, sign_artifact
from kiln.ops import registry
from kiln.runtime.environment import environment
from kiln.runtime.transforms import RejectedCandidate
from tests.unit.engine_testing import HANDWRITTEN_MLP, TINY_LLAMA, ZEROS_ATTENTION

SWAPS = Candidate.make(
    {"mlp": "handwritten", "attention": "sdpa", "qkv_proj": "fused", "rms_norm": "fused_residual"},
    transforms=[Transform.of("threads", n=1)],
    code_modules=[HANDWRITTEN_MLP],
)

REPO = str(Path(__file__).parents[2])


def _manifest(candidate: Candidate, **env: str) -> Manifest:
    return Manifest(
        model_name="tiny-llama",
        candidate_id=candidate.id,
        operating_point=MeasuredAt(
            batch_size=3, context_len=24, layers=2, total_layers=3, dtype="float32", device="cpu"
        ),
        weights=WeightsSource(kind="seeded_random", seed=7),
        measured=Measured(tokens_per_s=1234.5, median_ms=2.43, p10_ms=2.4, p90_ms=2.6, tier="full"),
        environment=env or environment("cpu"),
    )


KEY = Ed25519PrivateKey.generate()
TRUSTED = {key_id(KEY.public_key()): KEY.public_key()}


def _artifact(tmp_path: Path, candidate: Candidate = SWAPS, **env: str) -> Path:
    path = write_artifact(tmp_path / "art", _manifest(candidate, **env), candidate, TINY_LLAMA)
    sign_artifact(path, KEY)
    return path


def _load(path: Path) -> OptimizedModel:
    return load_optimized(path, trusted_keys=TRUSTED)


def test_manifest_round_trip(tmp_path: Path) -> None:
    path = _artifact(tmp_path)
    art = read_artifact(path)
    assert art.manifest == _manifest(SWAPS).model_copy(
        update={"code_module_files": ["code/00_handwritten_mlp.py"]}
    )
    assert art.candidate == SWAPS and art.candidate.id == SWAPS.id
    assert art.model_config == TINY_LLAMA
    assert (path / "code/00_handwritten_mlp.py").read_text() == HANDWRITTEN_MLP.source


def test_write_refuses_a_non_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "art").mkdir()
    (tmp_path / "art" / "x").write_text("x")
    with pytest.raises(ArtifactError, match="not an empty directory"):
        _artifact(tmp_path)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: m.__setitem__("schema_version", 9), "schema_version 9 is not supported"),
        (lambda m: m["measured"].__setitem__("tokens_per_s", -1), "measured.tokens_per_s"),
        (lambda m: m["operating_point"].pop("batch_size"), "operating_point.batch_size"),
        (lambda m: m.__setitem__("candidate_id", "abc"), "differs from the manifest"),
        (lambda m: m["weights"].__setitem__("kind", "s3"), "weights.kind"),
    ],
)
def test_a_corrupted_manifest_says_what_is_wrong(tmp_path: Path, edit, message: str) -> None:  # type: ignore[no-untyped-def]
    path = _artifact(tmp_path)
    raw = json.loads((path / MANIFEST).read_text())
    edit(raw)
    (path / MANIFEST).write_text(json.dumps(raw))
    with pytest.raises(ArtifactError, match=message):
        read_artifact(path)


def test_a_manifest_that_is_not_json(tmp_path: Path) -> None:
    path = _artifact(tmp_path)
    (path / MANIFEST).write_text("{not json")
    with pytest.raises(ArtifactError, match=r"manifest\.json is not valid JSON"):
        read_artifact(path)


def test_load_optimized_matches_the_reference(tmp_path: Path) -> None:
    """Op swaps plus a code module: the optimized model's logits equal the reference's on the
    same weights, at the operating point and after a prefill; release unregisters the
    module's implementation."""
    assert "handwritten" not in registry.implementations("mlp")
    opt = _load(_artifact(tmp_path))
    try:
        assert opt.model.binding.recipe["mlp"] == "handwritten"
        assert len(opt.model.ops.layers) == 2
        token = torch.tensor([[5], [17], [300]])
        opt.at_operating_point()
        got = opt.decode_step(token)
        opt.at_operating_point()
        want = opt.reference.decode_step(token)
        assert got.shape == (3, TINY_LLAMA["vocab_size"])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        prompts = torch.randint(512, (2, 8), generator=torch.Generator().manual_seed(1))
        a = opt.prefill(prompts)
        b = opt.reference.prefill(prompts)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        out = opt.generate(prompts, steps=3)
        assert out.shape == (2, 3) and out.dtype == torch.int64
    finally:
        opt.release()
    assert "handwritten" not in registry.implementations("mlp")
    with pytest.raises(RuntimeError, match="released"):
        opt.decode_step(token)


def test_a_wrong_candidate_differs_from_the_reference(tmp_path: Path) -> None:
    zeros = Candidate.make({"attention": "zeros"}, code_modules=[ZEROS_ATTENTION])
    opt = _load(_artifact(tmp_path, zeros))
    try:
        token = torch.tensor([[5], [17], [300]])
        got = opt.decode_step(token)
        opt.at_operating_point()
        assert not torch.allclose(got, opt.reference.decode_step(token), atol=1e-3)
    finally:
        opt.release()


def test_versions_that_differ_warn(tmp_path: Path) -> None:
    env = {**environment("cpu"), "torch": "0.0.1"}
    with pytest.warns(VersionWarning, match="torch"):
        _load(_artifact(tmp_path, **env)).release()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _load(_artifact(tmp_path / "same")).release()


def test_cuda_graph_on_cpu_is_rejected(tmp_path: Path) -> None:
    graphed = Candidate.make(transforms=[Transform.of("cuda_graph")])
    with pytest.raises(RejectedCandidate, match="CUDA"):
        _load(_artifact(tmp_path, graphed))


def _reproduce(path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    trusted = path.parent / "trusted.pub"
    trusted.write_bytes(public_pem(KEY.public_key()))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]
        ),
        "KILN_STATE_DIR": str(path.parent / "state"),
    }
    argv = [str(path), "--repeats", "5", "--trusted-key", str(trusted), *extra]
    return subprocess.run(
        [sys.executable, "-m", "kiln.export.reproduce", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )


def test_reproduce_in_a_fresh_process(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    done = _reproduce(_artifact(tmp_path), "--json", str(out))
    assert done.returncode == 0, done.stderr
    assert "recorded  1,234.5 tokens/s" in done.stdout
    assert "verdict   correct" in done.stdout
    figures = json.loads(out.read_text())
    assert figures["correct"] is True and figures["measured_tokens_per_s"] > 0
    assert figures["ratio"] == pytest.approx(figures["measured_tokens_per_s"] / 1234.5)


def test_reproduce_fails_an_incorrect_candidate(tmp_path: Path) -> None:
    zeros = Candidate.make({"attention": "zeros"}, code_modules=[ZEROS_ATTENTION])
    done = _reproduce(_artifact(tmp_path, zeros))
    assert done.returncode == 1
    assert "INCORRECT" in done.stdout


def test_reproduce_reports_a_bad_artifact(tmp_path: Path) -> None:
    done = _reproduce(tmp_path / "missing")
    assert done.returncode == 2
    assert "is not an artifact directory" in done.stderr


def test_reproduce_flags_a_noisy_timing() -> None:
    from kiln.export.reproduce import Reproduction, report_lines

    quiet = Reproduction(
        recorded_tokens_per_s=31.4,
        measured_tokens_per_s=30.0,
        ratio=30.0 / 31.4,
        median_ms=266.7,
        p10_ms=250.0,
        p90_ms=290.0,
        max_abs_error=0.01,
        tolerance=0.1,
        correct=True,
        reason="",
        device="cpu",
    )
    assert not any(line.startswith("note") for line in report_lines(quiet))
    assert "verdict   correct" in report_lines(quiet)
    noisy = Reproduction(**{**quiet.__dict__, "p10_ms": 378.0, "p90_ms": 1617.0})
    (note,) = [line for line in report_lines(noisy) if line.startswith("note")]
    assert "noisy timing: p10-p90 spans 465% of the median" in note


@pytest.mark.parametrize(
    ("event_type", "principal", "counts"),
    [
        ("BestCandidateImproved", "spiffe://kiln/service/agent-runner", True),
        ("ExperimentCompleted", "spiffe://kiln/service/engine-pool", True),
        ("BestCandidateImproved", "spiffe://kiln/team/mallory", False),
        ("ExperimentCompleted", "spiffe://kiln/operator/admin", False),
        ("ExperimentRequested", "spiffe://kiln/team/mallory", False),
        ("ExperimentCompleted", "", True),  # recorded before identities (or with TLS off)
        ("CompilationSubmitted", "spiffe://kiln/team/alpha", True),  # not a winner event
    ],
)
def test_only_service_identities_decide_the_exported_winner(
    event_type: str, principal: str, counts: bool
) -> None:
    from kiln.export.from_ledger import decides_the_winner
    from kiln.v1 import ledger_pb2

    event = ledger_pb2.RecordedEvent(type=event_type)
    event.metadata.principal = principal
    assert decides_the_winner(event) is counts
