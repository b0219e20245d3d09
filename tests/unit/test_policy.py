"""The authorization policy (kiln.common.policy) and the team rule of an identity
(kiln.common.identity.identity_for), as plain functions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.common.errors import InvalidArgument, PermissionDenied, Unauthenticated
from kiln.common.identity import CallIdentity, Principal, identity_for, parse_principal
from kiln.common.policy import DEFAULT_APPEND, DEFAULT_RPC, Policy, PolicyError, load_policy
from kiln.events.registry import event_categories

TEAM = CallIdentity("alpha", principal=Principal("team", "alpha"))
RUNNER = CallIdentity("alpha", principal=Principal("service", "agent-runner"))
ENGINE = CallIdentity("alpha", principal=Principal("service", "engine-pool"))
OPERATOR = CallIdentity("", principal=Principal("operator", "admin"))
NO_TLS = CallIdentity("alpha")


def _completed(status: str) -> tuple[str, bytes]:
    return "ExperimentCompleted", json.dumps({"status": status}).encode()


def test_principals_parse_from_kiln_uris_only() -> None:
    assert parse_principal("spiffe://kiln/team/alpha") == Principal("team", "alpha")
    for bad in ("spiffe://other/team/a", "spiffe://kiln/root/a", "spiffe://kiln/team/A B", "x"):
        with pytest.raises(ValueError):
            parse_principal(bad)


def test_the_team_of_a_call_comes_from_the_principal() -> None:
    team = Principal("team", "alpha")
    assert identity_for(team, []).team == "alpha"
    assert identity_for(team, [("kiln-team", "alpha")]).team == "alpha"
    with pytest.raises(PermissionDenied, match="may act only for team 'alpha'"):
        identity_for(team, [("kiln-team", "beta")])
    service = Principal("service", "agent-runner")
    assert identity_for(service, [("kiln-team", "beta")]).team == "beta"
    with pytest.raises(Unauthenticated, match="must name the team"):
        identity_for(service, [])
    operator = identity_for(Principal("operator", "admin"), [])
    assert operator.team == "" and operator.principal == Principal("operator", "admin")
    with pytest.raises(Unauthenticated):  # TLS off: the header is all there is
        identity_for(None, [])


def test_rpc_rules_by_principal_kind() -> None:
    policy = Policy()
    policy.check_call("/kiln.v1.Compiler/Submit", TEAM)
    policy.check_call("/kiln.v1.Ledger/Append", RUNNER)
    policy.check_call("/kiln.v1.Ledger/Replay", OPERATOR)
    policy.check_call("/kiln.v1.EnginePool/RunExperiment", OPERATOR)
    policy.check_call("/kiln.test.Anything/At", NO_TLS)  # TLS off: nothing is checked
    for method, who in [
        ("/kiln.v1.Ledger/Append", TEAM),
        ("/kiln.v1.Ledger/Replay", TEAM),
        ("/kiln.v1.Ledger/Replay", RUNNER),
        ("/kiln.v1.EnginePool/RunExperiment", TEAM),
        ("/kiln.v1.Compiler/Submit", OPERATOR),
    ]:
        with pytest.raises(PermissionDenied, match=f"may not call {method[1:]}"):
            policy.check_call(method, who)
    with pytest.raises(PermissionDenied, match="has no rule"):
        policy.check_call("/kiln.v1.Ledger/DropEverything", OPERATOR)


def test_append_rules_follow_who_appends_what() -> None:
    policy = Policy()
    stream = "experiment-e1"
    policy.check_append(ENGINE, stream, [_completed("ok")])
    policy.check_append(RUNNER, stream, [_completed("timed_out"), _completed("cancelled")])
    policy.check_append(RUNNER, stream, [("ExperimentRequested", b"{}")])
    policy.check_append(RUNNER, "compilation-c1", [("BestCandidateImproved", b"{}")])
    policy.check_append(NO_TLS, stream, [_completed("ok")])
    with pytest.raises(PermissionDenied, match=r"ExperimentCompleted \(status 'ok'\)"):
        policy.check_append(RUNNER, stream, [_completed("timed_out"), _completed("ok")])
    with pytest.raises(PermissionDenied, match="BestCandidateImproved"):
        policy.check_append(ENGINE, "compilation-c1", [("BestCandidateImproved", b"{}")])
    with pytest.raises(PermissionDenied, match="only service principals append"):
        policy.check_append(TEAM, stream, [_completed("ok")])
    with pytest.raises(PermissionDenied, match="only service principals append"):
        policy.check_append(OPERATOR, "compilation-c1", [("CompilationCancelRequested", b"{}")])
    with pytest.raises(InvalidArgument, match="not valid JSON"):
        policy.check_append(RUNNER, stream, [("ExperimentCompleted", b"{nope")])
    policy.check_append(ENGINE, stream, [("Mystery", b"{}")])  # unregistered: the store refuses


def test_every_event_type_has_a_writer_and_results_have_one_only() -> None:
    """A new event type needs a rule, or the service appending it is refused in production;
    measurements and bests each have exactly one writer."""
    written = {t for rule in DEFAULT_APPEND for t in rule.types}
    assert written == set(event_categories())
    writers = {
        t: {r.service for r in DEFAULT_APPEND if t in r.types and r.statuses is None}
        for t in written
    }
    assert writers["ExperimentCompleted"] == {"engine-pool"}
    assert writers["BestCandidateImproved"] == {"agent-runner"}
    assert all(r.category == event_categories()[t] for r in DEFAULT_APPEND for t in r.types)
    assert set(DEFAULT_RPC) >= {f"kiln.v1.Ledger/{m}" for m in ("Append", "Replay", "Query")}


def test_read_scope() -> None:
    assert Policy().read_scope(TEAM) == "alpha"
    assert Policy(cross_team_reads=True).read_scope(TEAM) is None
    for who in (RUNNER, OPERATOR, NO_TLS):
        assert Policy().read_scope(who) is None


def test_a_policy_file_overrides_what_it_names(tmp_path: Path) -> None:
    path = tmp_path / "policy.toml"
    path.write_text(
        "cross_team_reads = true\n"
        '[rpc]\n"kiln.v1.EnginePool/RunExperiment" = ["service", "operator", "team"]\n'
        '[[append]]\nservice = "engine-pool"\ncategory = "experiment"\n'
        'types = ["ExperimentCompleted"]\n'
    )
    policy = load_policy(path)
    assert policy.cross_team_reads
    policy.check_call("/kiln.v1.EnginePool/RunExperiment", TEAM)
    policy.check_call("/kiln.v1.Ledger/Append", RUNNER)  # other rpc rules kept
    with pytest.raises(PermissionDenied):  # the append rules were replaced whole
        policy.check_append(RUNNER, "experiment-e", [("ExperimentRequested", b"{}")])
    assert load_policy(None, cross_team_reads=True).cross_team_reads


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ('[rpc]\n"kiln.v1.Ledger/Append" = ["root"]\n', "rpc.kiln.v1.Ledger/Append"),
        ('[rpc]\n"/kiln.v1.Ledger/Append" = ["team"]\n', "package.Service/Method"),
        ('[[append]]\nservice = "x"\ncategory = "experiment"\ntypes = ["Nope"]\n', "Nope"),
        ("allow_everything = true\n", "allow_everything"),
        ("[rpc\n", "not TOML"),
    ],
)
def test_an_invalid_policy_file_is_one_line_naming_it(
    tmp_path: Path, text: str, problem: str
) -> None:
    path = tmp_path / "policy.toml"
    path.write_text(text)
    with pytest.raises(PolicyError) as err:
        load_policy(path)
    message = str(err.value)
    assert message.startswith(f"policy file {path}: ") and problem in message
    assert "\n" not in message
    with pytest.raises(PolicyError, match="policy file"):
        load_policy(tmp_path / "missing.toml")
