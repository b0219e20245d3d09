"""``kiln export`` against compilations in the real ledger (in-process ledger server over
gRPC, real PostgreSQL), then the artifact (signed with the state directory's deployment key)
loaded and checked against the reference."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

import kiln
from kiln.domain.candidate import REFERENCE_CANDIDATE, Candidate
from kiln.export.artifact import CANDIDATE, read_artifact
from kiln.export.signing import SIGNATURE, AlteredArtifact, UnsignedArtifact, key_id
from kiln.ledger.client import LedgerClient
from kiln.ledger.model import NewEvent
from kiln.runtime.environment import environment
from tests.unit.engine_testing import HANDWRITTEN_MLP, tiny_workload

from ..pki import ServiceLedger  # writes as the services do
from .events_factory import new_id
from .serving import run_command

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _state_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A state directory of the test's own: the CLI's signing key goes there, and
    ``load_optimized`` trusts its ``pki/signing.pub`` by default."""
    state = tmp_path_factory.mktemp("state")
    monkeypatch.setenv("KILN_STATE_DIR", str(state))
    monkeypatch.delenv("KILN_TRUSTED_KEYS", raising=False)
    return state


WINNER = Candidate.make({"mlp": "handwritten", "qkv_proj": "fused"}, code_modules=[HANDWRITTEN_MLP])


async def _compilation(
    client: LedgerClient, *, best: bool, reference_tps: float = 0.0
) -> tuple[str, str]:
    """A compilation whose candidate WINNER measured 500 tokens/s on the full tier (after a
    full-tier reference measurement at ``reference_tps``, when given)."""
    cid, eid = new_id(), new_id()
    workload = {**tiny_workload(batch=2, context=24), "workload_key": "wk-tiny"}
    await client.append(
        f"compilation-{cid}",
        [
            NewEvent(
                "CompilationSubmitted",
                {
                    "workload_key": "wk-tiny",
                    "model_name": "tiny-llama",
                    "hardware": "cpu",
                    "workload": workload,
                    "budget": {"wall_seconds": 60},
                },
            )
        ],
        "no_stream",
    )
    if reference_tps:
        ref = {"compilation_id": cid, "candidate_id": REFERENCE_CANDIDATE.id}
        await client.append(
            f"experiment-{new_id()}",
            [
                NewEvent(
                    "ExperimentRequested",
                    {
                        **ref,
                        "candidate": REFERENCE_CANDIDATE.canonical(),
                        "tier": "full",
                        "agent": "confirm",
                    },
                ),
                NewEvent(
                    "ExperimentCompleted",
                    {
                        **ref,
                        "status": "ok",
                        "correct": True,
                        "tokens_per_s": reference_tps,
                        "tier": "full",
                        "engine_id": "cpu-engine-1",
                    },
                ),
            ],
        )
    common = {"compilation_id": cid, "candidate_id": WINNER.id}
    await client.append(
        f"experiment-{eid}",
        [
            NewEvent(
                "ExperimentRequested",
                {**common, "candidate": WINNER.canonical(), "tier": "full", "agent": "confirm"},
            ),
            NewEvent(
                "ExperimentCompleted",
                {
                    **common,
                    "status": "ok",
                    "correct": True,
                    "median_ms": 4.0,
                    "p10_ms": 3.9,
                    "p90_ms": 4.2,
                    "tokens_per_s": 500.0,
                    "tier": "full",
                    "engine_id": "cpu-engine-1",
                    "device_ms": 900.0,
                    "environment": environment("cpu"),
                },
            ),
        ],
    )
    if best:
        await client.append(
            f"compilation-{cid}",
            [
                NewEvent(
                    "BestCandidateImproved",
                    {
                        "workload_key": "wk-tiny",
                        "experiment_id": eid,
                        "candidate_id": WINNER.id,
                        "tokens_per_s": 500.0,
                        "median_ms": 4.0,
                        "speedup": 1.25,
                        "tier": "full",
                        "elapsed_s": 12.0,
                        "experiments": 3,
                        "device_s": 2.5,
                    },
                )
            ],
        )
    return cid, eid


async def _kiln(addr: str, *args: str) -> tuple[int, str]:
    return await run_command("-m", "kiln", "--team", "search", "--ledger-addr", addr, *args)


async def test_export_writes_a_loadable_artifact(
    ledger_addr: str, tmp_path: Path, _state_dir: Path
) -> None:
    async with ServiceLedger(ledger_addr, "search") as client:
        cid, eid = await _compilation(client, best=True)
    out = tmp_path / "art"
    code, text = await _kiln(ledger_addr, "export", cid, "--out", str(out))
    assert code == 0, text
    assert "500.0 tokens/s" in text
    signature = json.loads((out / SIGNATURE).read_text())
    pub = (_state_dir / "pki" / "signing.pub").read_bytes()
    public = serialization.load_pem_public_key(pub)
    assert isinstance(public, Ed25519PublicKey)
    assert signature["key_id"] == key_id(public) and f"signed by key {key_id(public)[:16]}" in text
    art = read_artifact(out)
    m = art.manifest
    assert art.candidate == WINNER
    assert m.measured.experiment_id == eid and m.measured.engine_id == "cpu-engine-1"
    assert m.measured.speedup == 1.25 and m.measured.p90_ms == 4.2
    assert (m.operating_point.batch_size, m.operating_point.context_len) == (2, 24)
    assert m.operating_point.layers == 3 and m.operating_point.dtype == "float32"
    assert m.weights.kind == "seeded_random" and m.weights.seed == 7
    assert m.environment == environment("cpu")
    opt = kiln.load_optimized(out)
    try:
        token = torch.tensor([[3], [9]])
        got = opt.decode_step(token)
        opt.at_operating_point()
        torch.testing.assert_close(got, opt.reference.decode_step(token), rtol=1e-4, atol=1e-4)
    finally:
        opt.release()
    code, text = await _kiln(ledger_addr, "export", cid, "--out", str(out))
    assert code != 0 and "exists and is not an empty directory" in text
    # the same artifact altered after export, or stripped of its signature: refused
    original = (out / CANDIDATE).read_text()
    (out / CANDIDATE).write_text(original.replace("handwritten", "handwrittem", 1))
    with pytest.raises(AlteredArtifact, match=r"candidate\.json was altered after signing"):
        kiln.load_optimized(out)
    (out / CANDIDATE).write_text(original)
    (out / SIGNATURE).unlink()
    with pytest.raises(UnsignedArtifact):
        kiln.load_optimized(out)
    code, text = await _kiln(
        ledger_addr, "export", cid, "--out", str(tmp_path / "b"), "--candidate", WINNER.id
    )
    assert code == 0, text
    code, text = await _kiln(
        ledger_addr, "export", cid, "--out", str(tmp_path / "c"), "--candidate", "f" * 64
    )
    assert code != 0 and "was not requested correct on the full tier" in text


async def test_export_of_a_named_candidate_records_its_speedup_over_the_adjacent_reference(
    ledger_addr: str, tmp_path: Path
) -> None:
    async with ServiceLedger(ledger_addr, "search") as client:
        cid, eid = await _compilation(client, best=False, reference_tps=400.0)
    out = tmp_path / "named"
    code, text = await _kiln(
        ledger_addr, "export", cid, "--out", str(out), "--candidate", WINNER.id
    )
    assert code == 0, text
    measured = read_artifact(out).manifest.measured
    assert measured.experiment_id == eid and measured.speedup == pytest.approx(500.0 / 400.0)


async def test_export_errors(ledger_addr: str, tmp_path: Path) -> None:
    async with ServiceLedger(ledger_addr, "search") as client:
        cid, _ = await _compilation(client, best=False)
    code, text = await _kiln(ledger_addr, "export", cid, "--out", str(tmp_path / "a"))
    assert code != 0 and "has no confirmed best candidate yet" in text
    code, text = await _kiln(ledger_addr, "export", "nope" + new_id(), "--out", str(tmp_path))
    assert code != 0 and "no compilation" in text
