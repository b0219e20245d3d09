"""Running one of a deployment's compilations: the SubmitRequest it makes, submitting it through
the Compiler servicer as the deployment's team, and waiting for it to end.

The request is the deployment's workload at the compilation's shape, the policy's budget and
agents, no baselines, ``warm_start`` = the deployment's earlier compilations (+ nearby when the
policy says so) and ``incumbent_candidate_id`` = the active candidate (Contract 2). Its id is
fixed and recorded in ``RecompilationStarted`` before it is submitted: a restarted controller
submits it again and gets ALREADY_EXISTS (it was submitted) or a fresh submission (it was not);
once submitted, the agent runner resumes it like any open compilation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from google.protobuf.json_format import ParseDict

from kiln.agent_runner.compilation import CompilationRunner
from kiln.agent_runner.ledger_access import LedgerPool
from kiln.agent_runner.lookup import compilation_snapshot
from kiln.common.errors import AlreadyExists, NotFound
from kiln.common.identity import CallIdentity, use_call
from kiln.v1 import common_pb2, compiler_pb2, deployments_pb2

ENDED = (
    compiler_pb2.COMPILATION_STATUS_SUCCEEDED,
    compiler_pb2.COMPILATION_STATUS_FAILED,
    compiler_pb2.COMPILATION_STATUS_CANCELLED,
)
POLL_S = 2.0


class CompilerHost(Protocol):
    """What running a compilation needs of the agent runner's app."""

    ledger: LedgerPool

    def runner(self, compilation_id: str) -> CompilationRunner | None: ...

    async def submit_compilation(
        self, team: str, request: compiler_pb2.SubmitRequest
    ) -> compiler_pb2.Compilation: ...


def submit_request(
    compilation_id: str,
    workload: Mapping[str, Any],
    shape: Mapping[str, Any],
    policy: deployments_pb2.DeploymentPolicy,
    warm_start: Sequence[str],
    incumbent_candidate_id: str,
) -> compiler_pb2.SubmitRequest:
    """The SubmitRequest of one deployment compilation (see the module docs)."""
    message = ParseDict(
        {k: v for k, v in workload.items() if k != "workload_key"},
        common_pb2.Workload(),
        ignore_unknown_fields=True,
    )
    if shape:
        message.traffic.CopyFrom(ParseDict(dict(shape), common_pb2.TrafficShape()))
    request = compiler_pb2.SubmitRequest(
        compilation_id=compilation_id,
        workload=message,
        budget=policy.budget,
        agents=list(policy.agents),
        baselines=["none"],
        incumbent_candidate_id=incumbent_candidate_id,
    )
    if warm_start or policy.nearby:
        request.warm_start.CopyFrom(
            compiler_pb2.WarmStart(compilation_ids=list(warm_start), nearby=policy.nearby)
        )
    return request


async def submit(host: CompilerHost, team: str, request: compiler_pb2.SubmitRequest) -> bool:
    """Submit as ``team``; True when submitted now, False when it was submitted before."""
    with use_call(CallIdentity(team=team)):
        try:
            await host.submit_compilation(team, request)
        except AlreadyExists:
            return False
    return True


async def wait_ended(
    host: CompilerHost, compilation_id: str, closing: asyncio.Event
) -> compiler_pb2.Compilation:
    """The compilation once it has ended (its runner's ``finished``, else polling the ledger).

    Raises:
        asyncio.CancelledError: the controller stops (the compilation keeps running).
    """
    while True:
        runner = host.runner(compilation_id)
        if runner is not None:
            waiter = asyncio.ensure_future(runner.finished.wait())
            try:
                await asyncio.wait_for(asyncio.shield(waiter), POLL_S * 5)
            except TimeoutError:
                pass
            finally:
                waiter.cancel()
        try:
            snap = await compilation_snapshot(
                host.ledger, compilation_id, host.runner(compilation_id)
            )
        except NotFound:
            snap = None
        if snap is not None and snap.status in ENDED:
            return snap
        await asyncio.sleep(POLL_S)
