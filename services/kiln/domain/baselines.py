"""The side-by-side baselines' vocabulary (measured by :mod:`kiln.baselines`): their names, how a
compilation asks for them, and the agent name, candidate id and error prefix that mark their
experiments."""

from __future__ import annotations

from collections.abc import Iterable

from kiln.domain.quoting import quote

BASELINE_NAMES: tuple[str, ...] = ("hf_eager", "hf_static", "hf_compile", "gpt_fast")
"""Every baseline, in the order they are measured and printed (slowest expected first)."""

COMPARE_AGENT_PREFIX = "compare:"
"""Agent name of a baseline experiment: ``compare:<baseline name>``. Such experiments are
recorded (``ExperimentRequested`` / ``ExperimentCompleted``) like any other but are never a
candidate, a reference or a best: the agent runner keeps them out of its judged experiments."""

BASELINE_CANDIDATE_PREFIX = "baseline:"
"""``candidate_id`` of a baseline's measurement (``baseline:<name>``): its
``ExperimentCompleted`` names the baseline, not the placeholder candidate of its request."""


def parse_names(names: str | Iterable[str]) -> list[str]:
    """Baseline names from a comma-separated string or an iterable, stripped, lower-cased,
    de-duplicated in order; ``all`` stands for every name, ``none`` or empty for none.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    items = names.split(",") if isinstance(names, str) else list(names)
    out: list[str] = []
    for raw in items:
        name = raw.strip().lower()
        if not name or name == "none":
            continue
        chosen = list(BASELINE_NAMES) if name == "all" else [name]
        for n in chosen:
            if n not in BASELINE_NAMES:
                raise ValueError(
                    f"unknown baseline {quote(raw.strip())}; known: "
                    f"{', '.join(BASELINE_NAMES)}, all, none"
                )
            if n not in out:
                out.append(n)
    return out


def compare_agent(name: str) -> str:
    """The agent name of baseline ``name``'s experiment (``compare:<name>``)."""
    return COMPARE_AGENT_PREFIX + name


def baseline_of_agent(agent: str) -> str:
    """The baseline an experiment's agent name stands for, or "" for any other agent."""
    return agent[len(COMPARE_AGENT_PREFIX) :] if agent.startswith(COMPARE_AGENT_PREFIX) else ""


def default_baselines(hardware: str) -> list[str]:
    """The baselines a compilation measures when it asks for none explicitly: every one on a
    GPU target, none on ``cpu`` (or no hardware named): on a CPU the HF eager model at a real
    model size takes minutes and torch.compile longer."""
    name = hardware.strip().lower()
    return [] if name in ("", "cpu") else list(BASELINE_NAMES)


SKIPPED_PREFIX = "skipped: "
"""``Measurement.error`` / ``ExperimentCompleted.error`` of a baseline that did not run starts
with this (status ``rejected``); the rest is its ``skipped_reason``."""


def skipped_reason(status: str, error: str) -> str:
    """The skipped reason an experiment's status and error carry, or "" when it ran."""
    if status == "rejected" and error.startswith(SKIPPED_PREFIX):
        return error[len(SKIPPED_PREFIX) :]
    return ""
