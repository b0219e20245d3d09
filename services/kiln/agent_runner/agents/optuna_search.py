"""Model-based search: optuna's TPE sampler over the candidate space.

Each dimension is one categorical parameter; the study maximizes tokens/s, an incorrect or
failed candidate being a FAIL trial. Results of the compilation this agent did not ask for
become completed trials. A warm-started compilation's prior trials (``lab.prior_trials``:
candidates measured by earlier compilations, valued at the tokens/s predicted here,
:mod:`kiln.agent_runner.seeding`) are added once as completed trials (user attr ``prior``), so
the study continues from them; they do not make a point taken, so TPE may ask for one to be
measured here, and that fresh result becomes a trial of its own. A sampled point that is the
reference, claimed, tried or excluded is told FAIL (user attr ``skipped``) and TPE asked again,
at most :attr:`OptunaAgent.max_asks` times; then the first free point is enqueued. The study is
in memory unless ``KILN_OPTUNA_STORAGE`` names a database (docs/design/layers.md). Proposals run
in a worker thread, since optuna's storage calls block.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import optuna
import sqlalchemy
from optuna.distributions import BaseDistribution, CategoricalDistribution
from optuna.trial import TrialState, create_trial

from kiln.agent_runner.agents.base import Agent, Lab, Proposal
from kiln.agent_runner.agents.view import BoardView
from kiln.agent_runner.config import OptunaSettings
from kiln.agent_runner.results import Seen
from kiln.agent_runner.space import CandidateSpace
from kiln.common.logging import get_logger
from kiln.domain.candidate import Candidate

log = get_logger("kiln.agent_runner.optuna")
optuna.logging.set_verbosity(optuna.logging.WARNING)

MEMORY = "memory"
_MEMORY_NAMES = {MEMORY, "in-memory", ":memory:"}
MAX_FALLBACK_SCAN = 100_000
"""Points of the space scanned for a free one when the sampler keeps repeating itself."""

_storages: dict[tuple[str, str], optuna.storages.BaseStorage] = {}
_storages_lock = threading.Lock()


def sync_url(url: str) -> str:
    """``url`` with ``postgresql+asyncpg`` or bare ``postgresql`` made ``postgresql+psycopg``."""
    if url.startswith("postgresql+asyncpg://"):
        return "postgresql+psycopg://" + url[len("postgresql+asyncpg://") :]
    if url.startswith(("postgresql://", "postgres://")):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


def resolve_storage(explicit: str | None = None) -> str | None:
    """The studies' SQLAlchemy URL: ``explicit``, else ``KILN_OPTUNA_STORAGE``; None (also for
    ``memory`` or ``in-memory``) for in memory.
    """
    url = explicit or OptunaSettings().storage
    if url is None or url.strip().lower() in _MEMORY_NAMES:
        return None
    return sync_url(url.strip())


def open_storage(url: str | None, schema: str | None = None) -> optuna.storages.BaseStorage:
    """The storage at ``url`` (None: in memory), one per (url, schema) in this process; on
    Postgres in ``schema`` (default ``KILN_OPTUNA_DB_SCHEMA``), created if missing, away from the
    ledger's tables. Raises SQLAlchemyError when the database fails.
    """
    if url is None:
        return optuna.storages.InMemoryStorage()
    schema = schema or OptunaSettings().db_schema
    key = (url, schema)
    with _storages_lock:
        storage = _storages.get(key)
        if storage is None:
            storage = _storages[key] = _rdb_storage(url, schema)
        return storage


def _rdb_storage(url: str, schema: str) -> optuna.storages.RDBStorage:
    if not url.startswith("postgresql"):
        return optuna.storages.RDBStorage(url)
    engine = sqlalchemy.create_engine(url)
    try:
        with engine.begin() as conn:
            exists = conn.execute(
                sqlalchemy.text("SELECT 1 FROM pg_namespace WHERE nspname = :s"), {"s": schema}
            ).first()
            if exists is None:
                try:
                    conn.execute(sqlalchemy.text(f'CREATE SCHEMA IF NOT EXISTS "{schema}"'))
                except sqlalchemy.exc.IntegrityError:
                    pass  # another process created it at the same moment
    finally:
        engine.dispose()
    kwargs: dict[str, Any] = {
        "connect_args": {"options": f"-csearch_path={schema}"},
        "pool_pre_ping": True,
    }
    return optuna.storages.RDBStorage(url, engine_kwargs=kwargs)


def study_name(compilation_id: str, agent: str) -> str:
    """``kiln-<compilation id>-<agent name>``: one study per agent of a compilation."""
    return f"kiln-{compilation_id}-{agent}"


class OptunaAgent(Agent):
    """TPE over the candidate space (the seed seeds TPE); ``storage`` a URL or ``memory`` (None:
    :func:`resolve_storage`), ``schema`` its Postgres schema.
    """

    kind = "optuna"
    max_asks: ClassVar[int] = 16
    """Sampler asks per proposal before falling back to the first free point."""

    def __init__(
        self, name: str, seed: int, storage: str | None = None, schema: str | None = None
    ) -> None:
        super().__init__(name, seed)
        self._storage_arg = storage
        self._schema = schema
        self._study: optuna.Study | None = None
        self._pending: dict[str, int] = {}
        """Candidate id -> trial number asked and not told yet."""
        self._known: set[str] = set()
        """Candidate ids whose trial is finished in the study."""
        self._priors: set[str] = set()
        """Candidate ids told to the study as prior trials."""

    # ------------------------------------------------------------------ the loop's hooks
    async def next_proposal(self, view: BoardView, lab: Lab) -> Proposal | None:
        """:meth:`propose` in a worker thread, on a copy of the view (optuna blocks)."""
        cid, claimed, results = view.compilation_id, set(view.claimed), dict(view.results)
        priors = list(getattr(lab, "prior_trials", ()))
        return await asyncio.to_thread(self._propose, cid, claimed, results, lab.space, priors)

    def propose(self, view: BoardView, space: CandidateSpace) -> Proposal | None:
        """Fold the view's new results into the study, then ask TPE for a free point; raises
        SQLAlchemyError when the database fails.
        """
        return self._propose(view.compilation_id, set(view.claimed), dict(view.results), space)

    @property
    def study(self) -> optuna.Study | None:
        """The study (None before the first proposal)."""
        return self._study

    # ------------------------------------------------------------------ internals
    def _open(self, compilation_id: str) -> optuna.Study:
        if self._study is None:
            url = resolve_storage(self._storage_arg)
            study = optuna.create_study(
                study_name=study_name(compilation_id, self.name),
                storage=open_storage(url, self._schema),
                sampler=optuna.samplers.TPESampler(seed=self.seed % 2**32),
                direction="maximize",
                load_if_exists=True,
            )
            for t in study.get_trials(deepcopy=False):
                cid = t.user_attrs.get("candidate_id")
                if not cid:
                    continue
                if t.user_attrs.get("prior"):
                    self._priors.add(cid)
                    continue
                if t.state == TrialState.RUNNING:
                    self._pending[cid] = t.number
                else:
                    self._known.add(cid)
            if study.trials:
                log.info("optuna study resumed", agent=self.name, trials=len(study.trials))
            self._study = study
        return self._study

    def _propose(
        self,
        compilation_id: str,
        claimed: set[str],
        results: Mapping[str, Seen],
        space: CandidateSpace,
        priors: Sequence[tuple[Candidate, float]] = (),
    ) -> Proposal | None:
        study = self._open(compilation_id)
        dists: dict[str, BaseDistribution] = {
            d.name: CategoricalDistribution(d.values) for d in space.dims
        }
        self._tell_priors(study, priors, space, dists)
        self._fold(study, results, space, dists)
        for cid in [c for c in self._pending if c not in claimed and c not in self.tried]:
            study.tell(self._pending.pop(cid), state=TrialState.FAIL)  # asked, never claimed
            self._known.add(cid)
        taken = claimed | self.tried | self._known | self._pending.keys()
        for _ in range(self.max_asks):
            trial = study.ask(dists)
            candidate = space.candidate(trial.params)
            skipped = (
                "reference"
                if candidate.is_reference
                else "taken"
                if candidate.id in taken
                else space.excluded(trial.params)
            )
            if skipped is not None:
                trial.set_user_attr("skipped", skipped)
                study.tell(trial, state=TrialState.FAIL)
                continue
            return self._proposal(trial, candidate, "TPE")
        free = self._first_free(space, taken)
        if free is None:
            return None
        study.enqueue_trial(space.assignment(free))
        trial = study.ask(dists)
        return self._proposal(trial, space.candidate(trial.params), "first free point")

    def _proposal(self, trial: optuna.Trial, candidate: Candidate, how: str) -> Proposal:
        trial.set_user_attr("candidate_id", candidate.id)
        self._pending[candidate.id] = trial.number
        done = len(self._known)
        why = f"optuna {how} (seed {self.seed}), trial {trial.number}, {done} results modelled"
        return Proposal(candidate, why)

    def _tell_priors(
        self,
        study: optuna.Study,
        priors: Sequence[tuple[Candidate, float]],
        space: CandidateSpace,
        dists: dict[str, BaseDistribution],
    ) -> None:
        """Add the prior trials not added yet (see the module docs)."""
        for candidate, value in priors:
            if candidate.id in self._priors or not space.contains(candidate) or value <= 0:
                continue
            self._priors.add(candidate.id)
            study.add_trial(
                create_trial(
                    params=space.assignment(candidate),
                    distributions=dists,
                    value=value,
                    user_attrs={"candidate_id": candidate.id, "prior": True},
                )
            )

    def _fold(
        self,
        study: optuna.Study,
        results: Mapping[str, Seen],
        space: CandidateSpace,
        dists: dict[str, BaseDistribution],
    ) -> None:
        """Tell this agent's trials their results; add everyone else's as finished trials."""
        for cid, seen in results.items():
            if cid in self._known:
                continue
            self._known.add(cid)
            value = seen.tokens_per_s if seen.ok and seen.tokens_per_s > 0 else None
            number = self._pending.pop(cid, None)
            if number is not None:
                if value is None:
                    study.tell(number, state=TrialState.FAIL)
                else:
                    study.tell(number, value)
                continue
            if not space.contains(seen.candidate):
                continue
            study.add_trial(
                create_trial(
                    params=space.assignment(seen.candidate),
                    distributions=dists,
                    value=value,
                    state=TrialState.COMPLETE if value is not None else TrialState.FAIL,
                    user_attrs={"candidate_id": cid, "agent": seen.agent},
                )
            )

    @staticmethod
    def _first_free(space: CandidateSpace, taken: set[str]) -> Candidate | None:
        for i, candidate in enumerate(space):
            if i >= MAX_FALLBACK_SCAN:
                return None
            if candidate.id not in taken:
                return candidate
        return None
