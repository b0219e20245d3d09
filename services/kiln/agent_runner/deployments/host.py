"""The deployments of one agent runner: finding them in the ledger, reading one back, and one
controller task per deployment that has not failed.

At start every ``DeploymentCreated`` of the ledger is found (``ReadAll`` over the
``deployment-`` streams) and its controller started; Create starts the new one's. A controller
that crashes is logged and started again after a pause from the stream (its state is the
stream). On shutdown they are cancelled; their compilations stay open for the next process.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars

from kiln.agent_runner.deployments.controller import ControllerHost, DeploymentController
from kiln.agent_runner.ledger_access import LedgerPool
from kiln.agent_runner.tasks import cancel_and_wait
from kiln.common.errors import NotFound
from kiln.common.logging import get_logger
from kiln.domain import streams
from kiln.domain.deployment import DeploymentState, Status
from kiln.ledger.convert import recorded_to_domain

log = get_logger("kiln.agent_runner.deployments")

RESTART_PAUSE_S = 3.0


async def read_deployment(ledger: LedgerPool, deployment_id: str) -> DeploymentState:
    """The deployment's stream folded.

    Raises:
        NotFound: no such deployment (the message does not say whose it would be).
    """
    try:
        events = await ledger.system.read_stream(streams.deployment_stream(deployment_id))
    except NotFound:
        raise NotFound("no such deployment") from None
    return DeploymentState.fold(recorded_to_domain(e) for e in events)


async def deployment_ids(ledger: LedgerPool, team: str | None = None) -> list[str]:
    """Ids of every deployment (only ``team``'s when given), in creation order."""
    found: list[str] = []
    async for event in ledger.system.read_all(
        0, types=["DeploymentCreated"], stream_prefix=streams.DEPLOYMENT_PREFIX
    ):
        did = streams.stream_suffix(event.stream_id, streams.DEPLOYMENT_PREFIX)
        if did is None or (team is not None and event.metadata.team != team):
            continue
        found.append(did)
    return found


class DeploymentControllers:
    """The controllers running in this process, by deployment id."""

    def __init__(self, host: ControllerHost, retry_s: float = RESTART_PAUSE_S) -> None:
        self._host = host
        self._retry_s = retry_s
        self._controllers: dict[str, DeploymentController] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def get(self, deployment_id: str) -> DeploymentController | None:
        """The controller of a deployment running here, else None."""
        return self._controllers.get(deployment_id)

    def start(self, state: DeploymentState) -> None:
        """Run the deployment's controller (no-op when it runs, or the deployment failed)."""
        did = state.deployment_id
        if did in self._tasks or state.status == Status.FAILED:
            return
        self._tasks[did] = asyncio.create_task(
            self._keep_running(state), name=f"kiln-deployment-{did}", context=contextvars.Context()
        )

    async def _keep_running(self, state: DeploymentState) -> None:
        did = state.deployment_id
        try:
            while True:
                controller = self._controllers[did] = DeploymentController(self._host, state)
                try:
                    await controller.run()
                    return
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    log.error("deployment controller failed", deployment=did, error=repr(exc))
                await asyncio.sleep(self._retry_s)
                while True:
                    try:
                        state = await read_deployment(self._host.ledger, did)
                        break
                    except Exception as exc:
                        log.warning("cannot re-read deployment", deployment=did, error=str(exc))
                        await asyncio.sleep(self._retry_s)
                if state.status == Status.FAILED:
                    return
        finally:
            self._tasks.pop(did, None)
            self._controllers.pop(did, None)

    async def resume_all(self) -> None:
        """Start the controllers of every deployment in the ledger (retrying while it is
        unreachable)."""
        while True:
            try:
                ids = await deployment_ids(self._host.ledger)
                break
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("cannot list deployments yet; retrying", error=str(exc))
                await asyncio.sleep(self._retry_s)
        for did in ids:
            with contextlib.suppress(NotFound):
                state = await read_deployment(self._host.ledger, did)
                self.start(state)

    async def stop(self) -> None:
        """Cancel every controller."""
        await asyncio.gather(*(cancel_and_wait(t) for t in list(self._tasks.values())))
