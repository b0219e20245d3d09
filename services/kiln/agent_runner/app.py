"""The agent runner service process, host of the Compiler API.

On start it connects to NATS (creating the board and work-queue streams if needed), registers
the ``kiln.v1.Compiler`` servicer, and resumes the open compilations it finds in the ledger in
the background. One runner task per running compilation; one shared ledger follower for
experiment results and cancel requests. On shutdown Watch streams end (UNAVAILABLE), runners
stop without ending their compilations, and the next process resumes them.

Run a single agent runner per ledger: a second one would resume, and run, the compilations the
first is running (their deterministic event ids make the ledger refuse the second copy's
conflicting events, so one copy then fails; it does not corrupt the record).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from typing import Any

import grpc
from nats.aio.client import Client

from kiln.agent_runner.admission import Admission
from kiln.agent_runner.compilation import CompilationRunner, RunnerDeps
from kiln.agent_runner.config import RunnerConfig, RunnerSettings
from kiln.agent_runner.deployments.feed import TrafficFeed
from kiln.agent_runner.deployments.host import DeploymentControllers
from kiln.agent_runner.deployments.service import DeploymentsServicer
from kiln.agent_runner.dispatcher import ExperimentDispatcher
from kiln.agent_runner.ledger_access import LedgerPool
from kiln.agent_runner.pools import EnginePools
from kiln.agent_runner.quotas import QuotaSettings
from kiln.agent_runner.resume import load_open_states, open_compilation_ids
from kiln.agent_runner.service import CompilerServicer
from kiln.agent_runner.space import CandidateSpace, space_for
from kiln.agent_runner.state import CompilationState
from kiln.agent_runner.tasks import cancel_and_wait
from kiln.agent_runner.team_usage import TeamUsage
from kiln.board import Board
from kiln.common import tracing
from kiln.common.client import team_channel
from kiln.common.logging import get_logger
from kiln.common.nats import connect, ensure_streams, owned_streams
from kiln.common.settings import KilnSettings
from kiln.domain.compilation import Status
from kiln.v1 import compiler_pb2, compiler_pb2_grpc, cost_model_pb2_grpc, deployments_pb2_grpc

log = get_logger("kiln.agent_runner")


class AgentRunnerApp:
    """``ServiceApp`` of the agent runner (see ``kiln.common.server``).

    Args:
        settings: ledger, cost model and NATS addresses, subject prefix, own team name.
        config: tunables (default: :class:`RunnerSettings`'s deadlines, the rest as in
            :class:`RunnerConfig`).
        quotas: the teams' quotas (default: from ``KILN_QUOTA_*``).
    """

    name = "agent-runner"
    grpc_service_names = ("kiln.v1.Compiler", "kiln.v1.Deployments")

    def __init__(
        self,
        settings: KilnSettings,
        config: RunnerConfig | None = None,
        quotas: QuotaSettings | None = None,
    ) -> None:
        self.settings = settings
        self.config = config or RunnerSettings().config()
        self.quotas = quotas or QuotaSettings()
        limited = self.quotas.device_seconds or any(
            t.device_seconds for t in self.quotas.teams.values()
        )
        self.usage = TeamUsage(self.quotas.period_s) if limited else None
        """The teams' device time, read from the ledger (only when some team's is limited)."""
        self.admission = Admission(self.quotas, self.usage)
        self.closing = asyncio.Event()
        """Set when shutdown begins: Watch streams end."""
        self.resumed = asyncio.Event()
        """Set once the open compilations found at start are running again."""
        self.ledger = LedgerPool(settings.ledger_addr, settings.team)
        self.pools = EnginePools(
            settings.engine_pool_addr, settings.team, self.config.pools_timeout_s
        )
        """The engine pools' registry, read at Submit (:mod:`kiln.agent_runner.pools`)."""
        self._nc: Client | None = None
        self._deps: RunnerDeps | None = None
        self._dispatcher: ExperimentDispatcher | None = None
        self._runners: dict[str, CompilationRunner] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._reserved: set[str] = set()
        self._cost_channels: dict[str, grpc.aio.Channel] = {}
        self._spaces: dict[str, CandidateSpace] = {}
        self._background: list[asyncio.Task[None]] = []
        self.compiler = CompilerServicer(self)
        self.deployments = DeploymentControllers(self)
        """The deployments' controllers (kiln.agent_runner.deployments)."""
        self._feed: TrafficFeed | None = None

    # ------------------------------------------------------------------ lifecycle
    async def start(self, server: grpc.aio.Server) -> None:
        """Connect to NATS, register the servicer, start resuming open compilations.

        Raises:
            Unavailable: NATS cannot be reached.
            Unauthenticated: NATS refused the credentials.
            RuntimeError: no NATS URL is configured, or its credentials are incomplete.
        """
        prefix = self.settings.subject_prefix
        credentials = self.settings.nats_credentials()
        url = self.settings.require_nats_url()
        self._nc = await connect(url, name="kiln-agent-runner", credentials=credentials)
        js = self._nc.jetstream()
        await ensure_streams(js, prefix, owned_streams(self.name, open_server=credentials is None))
        self._dispatcher = ExperimentDispatcher(
            self.ledger, js, prefix, self.config, self._on_cancel
        )
        self._deps = RunnerDeps(
            ledger=self.ledger,
            dispatcher=self._dispatcher,
            board=Board(js, prefix),
            cost_model=self._cost_model,
            cost_model_addr=self.settings.cost_model_addr,
            space=self._space,
            config=self.config,
            admission=self.admission,
        )
        self._feed = TrafficFeed(js, prefix)
        compiler_pb2_grpc.add_CompilerServicer_to_server(self.compiler, server)
        deployments_pb2_grpc.add_DeploymentsServicer_to_server(DeploymentsServicer(self), server)
        if self.usage is not None:
            self._background.append(asyncio.create_task(self._follow_usage(), name="kiln-ar-usage"))
        self._background.append(asyncio.create_task(self._resume(), name="kiln-ar-resume"))
        self._background.append(asyncio.create_task(self._warm_up(), name="kiln-ar-warm-up"))
        self._background.append(
            asyncio.create_task(self._resume_deployments(), name="kiln-ar-deployments")
        )

    async def is_ready(self) -> bool:
        """True while NATS is connected."""
        return self._nc is not None and self._nc.is_connected

    async def draining(self) -> None:
        """End Watch streams so the server drains promptly."""
        self.closing.set()

    async def stop(self) -> None:
        """Stop the runners (their compilations stay open for the next process), the follower
        and the connections."""
        self.closing.set()
        await self.deployments.stop()
        tasks = [*self._background, *self._tasks.values()]
        await asyncio.gather(*(cancel_and_wait(t) for t in tasks))
        if self._dispatcher is not None:
            await self._dispatcher.close_all()
        if self._nc is not None:
            with contextlib.suppress(Exception):
                await self._nc.close()
        for ch in self._cost_channels.values():
            await ch.close(None)
        await self.pools.close()
        await self.ledger.close()

    # ------------------------------------------------------------------ runners
    def reserve_id(self, compilation_id: str) -> bool:
        """Hold a compilation id while it is being submitted; False when it is held or runs."""
        if compilation_id in self._reserved or compilation_id in self._runners:
            return False
        self._reserved.add(compilation_id)
        return True

    def release_id(self, compilation_id: str) -> None:
        """Let go of a held id (its runner, if started, keeps it taken)."""
        self._reserved.discard(compilation_id)

    def runner(self, compilation_id: str) -> CompilationRunner | None:
        """The runner of a compilation running in this process, else None."""
        return self._runners.get(compilation_id)

    def start_runner(self, state: CompilationState, *, resumed: bool = False) -> CompilationRunner:
        """Run a compilation in the background."""
        assert self._deps is not None, "start() first"
        cid = state.compilation_id
        runner = CompilationRunner(state, self._deps, resumed=resumed)
        self._runners[cid] = runner
        # A fresh context: the runner outlives the RPC that started it (and its log context);
        # its trace continues the RPC's (Submit's), in a span of its own.
        task = asyncio.create_task(
            _traced(runner, tracing.capture(), resumed),
            name=f"kiln-compilation-{cid}",
            context=contextvars.Context(),
        )
        self._tasks[cid] = task

        def done(_: asyncio.Task[None]) -> None:
            self._tasks.pop(cid, None)
            if self._runners.get(cid) is runner:
                del self._runners[cid]

        task.add_done_callback(done)
        return runner

    def _on_cancel(self, compilation_id: str, reason: str) -> None:
        runner = self._runners.get(compilation_id)
        if runner is not None:
            runner.request_cancel(reason)

    async def _resume(self) -> None:
        """Resume every open compilation (retrying while the ledger is unreachable)."""
        while True:
            try:
                ids = await open_compilation_ids(self.ledger)
                ids = [i for i in ids if i not in self._runners and i not in self._reserved]
                states = await load_open_states(self.ledger, ids)
                break
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("cannot resume yet; retrying", error=str(exc))
                await asyncio.sleep(self.config.resume_retry_s)
        # Running ones first (they keep their slots), then the pending in submission order, so
        # that admission queues them as they were submitted.
        states.sort(key=lambda s: (s.compilation.status != Status.RUNNING, s.submitted_position))
        for state in states:
            if self.reserve_id(state.compilation_id):
                self.release_id(state.compilation_id)
                log.info(
                    "resuming compilation",
                    compilation=state.compilation_id,
                    experiments=len(state.experiments),
                )
                self.start_runner(state, resumed=True)
        self.resumed.set()

    async def _resume_deployments(self) -> None:
        """Start the deployments' controllers once the open compilations run again (a
        controller waits for its recompilation's runner)."""
        await self.resumed.wait()
        await self.deployments.resume_all()

    @property
    def feed(self) -> TrafficFeed:
        """The deployments' traffic feed (after start)."""
        assert self._feed is not None, "start() first"
        return self._feed

    async def submit_compilation(
        self, team: str, request: compiler_pb2.SubmitRequest
    ) -> compiler_pb2.Compilation:
        """``Compiler.Submit`` for ``team`` from inside the process (a deployment's
        compilations; the caller sets the call identity)."""
        return await self.compiler.Submit(request, None)

    def cost_model_for(self, team: str) -> cost_model_pb2_grpc.CostModelStub:
        """The cost model's stub for ``team``'s calls."""
        return self._cost_model(team)

    async def _follow_usage(self) -> None:
        """Read the teams' device time from the ledger and follow it (see ``TeamUsage.run``)."""
        assert self.usage is not None
        while True:
            try:
                head = (await self.ledger.query_page("compilations", limit=1)).checkpoint_position
                break
            except Exception as exc:  # the ledger is not up yet: the reader retries too
                log.warning("cannot read the ledger's position yet; retrying", error=str(exc))
                await asyncio.sleep(self.config.resume_retry_s)
        await self.usage.run(self.ledger.system, head)

    async def _warm_up(self) -> None:
        """Build the CPU space in a thread (its first use imports torch, seconds of work)."""
        try:
            await asyncio.to_thread(self._space, "cpu")
        except Exception as exc:
            log.error("cannot build the candidate space", error=repr(exc))

    # ------------------------------------------------------------------ shared helpers
    def _cost_model(self, team: str) -> cost_model_pb2_grpc.CostModelStub:
        ch = self._cost_channels.get(team)
        if ch is None:
            ch = self._cost_channels[team] = team_channel(self.settings.cost_model_addr, team)
        return cost_model_pb2_grpc.CostModelStub(ch)

    def _space(self, hardware: str) -> CandidateSpace:
        key = hardware.strip().lower()
        space = self._spaces.get(key)
        if space is None:
            space = self._spaces[key] = space_for(key)
        return space


def create_app(settings: KilnSettings) -> AgentRunnerApp:
    """The agent runner's ``ServiceApp`` (``kiln serve agent-runner``)."""
    return AgentRunnerApp(settings)


async def _traced(runner: CompilationRunner, parent: Any, resumed: bool) -> None:
    """``runner.run()`` inside a ``kiln.compilation`` span, child of ``parent`` (None: a new
    trace, as for a compilation resumed after a restart)."""
    state = runner.state
    with tracing.span(
        "kiln.compilation",
        parent=parent,
        compilation_id=state.compilation_id,
        team=state.team,
    ) as span:
        tracing.set_attributes(span, {"kiln.resumed": resumed})
        await runner.run()
