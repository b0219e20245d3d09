"""One compilation's page, its live JSON and the shareable report.

The page: a summary, the best-so-far plot (inline SVG, :mod:`kiln.dashboard.svg`), the
baselines table, the experiments table with status/tier/agent filters (applied server-side from
the query string, client-side by the script) and each experiment's phases, and the board.
:func:`live_json` gives the fragments the script swaps in while it runs. :func:`report_html` is
the same content as one self-contained file: inline CSS and SVG, no script, no external asset.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from kiln.dashboard.pages import comp_href, e, layout, num, table
from kiln.dashboard.svg import step_plot
from kiln.dashboard.view import CompilationView, Experiment, status_name

FILTERS = ("status", "tier", "agent")
"""Query parameters that filter the experiments table."""

POLL_MS = 2000
"""How often a running compilation's page asks for news."""


def plot_svg(view: CompilationView) -> str:
    """The best-so-far per agent over seconds since submission."""
    return step_plot(
        view.curves(),
        title="best-so-far tokens/s per agent",
        x_max=view.elapsed_now(),
    )


def summary_html(view: CompilationView) -> str:
    """The compilation's key facts as a ``<dl>``."""
    s = view.snapshot
    status = status_name(s.status)
    w = s.workload
    items: list[tuple[str, str]] = [
        ("status", f'<span class="status-{e(status)}" id="status">{e(status)}</span>'),
        ("outcome", e(s.outcome or "-")),
        ("team", e(s.team)),
        ("model", e(w.model.name)),
        (
            "hardware",
            e(w.hardware.name)
            + (f" x{w.hardware.num_devices}" if w.hardware.num_devices > 1 else ""),
        ),
        ("traffic", e(f"batch {w.traffic.batch_size}, context {w.traffic.context_len}")),
        (
            "budget",
            e(f"{s.budget.wall_seconds:g} s")
            + (f", {s.budget.max_experiments} experiments" if s.budget.max_experiments else ""),
        ),
        (
            "experiments",
            f"{s.experiments_done} done, {s.failures} failed, {s.experiments_reused} reused",
        ),
    ]
    if s.HasField("baseline"):
        items.append(("reference", e(f"{num(s.baseline.tokens_per_s)} tok/s")))
    if s.HasField("best"):
        b = s.best
        items.append(
            (
                "best",
                e(
                    f"{num(b.measurement.tokens_per_s)} tok/s ({b.speedup:.2f}x), "
                    f"candidate {b.candidate.candidate_id[:16]}"
                ),
            )
        )
    if s.reason:
        items.append(("reason", e(s.reason)))
    for u in s.agent_usage:
        items.append(
            (
                f"agent {e(u.agent)}",
                e(
                    f"{u.experiments} experiments ({u.ok} ok, {u.failed} failed), "
                    f"{u.device_seconds:.1f} device s, best {num(u.best_tokens_per_s)} tok/s"
                ),
            )
        )
    return "".join(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in items)


def _phases(exp: Experiment) -> str:
    if not exp.phases_ms:
        return '<span class="muted">no phases recorded</span>'
    total = sum(exp.phases_ms.values()) or 1.0
    cells = "".join(
        f'<tr class="phase"><td>{e(k)}</td><td class="num">{v:,.1f}</td>'
        f'<td class="num">{100 * v / total:.0f} %</td></tr>'
        for k, v in exp.phases_ms.items()
    )
    return f'<table class="phases"><tr><th>phase</th><th>ms</th><th>share</th></tr>{cells}</table>'


def _matches(exp: Experiment, filters: Mapping[str, str]) -> bool:
    return all(not filters.get(k) or getattr(exp, k) == filters[k] for k in FILTERS)


def experiment_rows(view: CompilationView, filters: Mapping[str, str]) -> str:
    """The experiments table's ``<tr>`` rows (newest first), filtered; each followed by a
    row with its phases and error."""
    out = []
    exps = sorted(view.experiments.values(), key=lambda x: -(x.requested_s or 0.0))
    for x in exps:
        if not _matches(x, filters):
            continue
        bad = x.status not in ("ok", "running") or (x.status == "ok" and not x.correct)
        cls = "exp bad" if bad else "exp"
        at = f"{x.completed_s:.1f}" if x.completed_s is not None else "-"
        err = f"<pre class='msg'>{e(x.error[:4000])}</pre>" if x.error else ""
        out.append(
            f'<tr class="{cls}" data-id="{e(x.experiment_id)}" data-status="{e(x.status)}" '
            f'data-tier="{e(x.tier)}" data-agent="{e(x.agent)}">'
            f"<td>{e(x.experiment_id[:20])}</td><td>{e(x.agent or '-')}</td><td>{e(x.tier)}</td>"
            f"<td>{e(x.candidate_id[:16])}</td><td>{e(x.status)}</td>"
            f"<td>{'yes' if x.correct else 'no'}</td>"
            f'<td class="num">{num(x.tokens_per_s)}</td><td class="num">{num(x.median_ms, 3)}</td>'
            f'<td class="num">{at}</td></tr>'
            f'<tr class="detail" id="phases-{e(x.experiment_id)}"><td colspan="9"><details>'
            f"<summary>phases{' and error' if x.error else ''}</summary>{_phases(x)}{err}"
            "</details></td></tr>"
        )
    return "".join(out)


def _select(name: str, options: list[str], chosen: str) -> str:
    opts = ['<option value="">any</option>'] + [
        f'<option value="{e(o)}"{" selected" if o == chosen else ""}>{e(o)}</option>'
        for o in options
    ]
    select = f'<select id="f-{e(name)}" name="{e(name)}">{"".join(opts)}</select>'
    return f"<label>{e(name)} {select}</label>"


def _filters_form(view: CompilationView, filters: Mapping[str, str]) -> str:
    exps = view.experiments.values()
    choices = {
        "status": sorted({x.status for x in exps} | {"ok", "incorrect", "crashed", "timed_out"}),
        "tier": sorted({x.tier for x in exps if x.tier} | {"fast", "full"}),
        "agent": view.agents(),
    }
    selects = "".join(_select(k, choices[k], filters.get(k, "")) for k in FILTERS)
    return (
        f'<form class="filters" method="get" action="{e(comp_href(view.compilation_id))}">'
        f'{selects}<button type="submit">filter</button> <span id="exp-count"></span></form>'
    )


def baselines_html(view: CompilationView) -> str:
    """The baselines measured beside the search, with kiln's reference and best."""
    s = view.snapshot
    rows = []
    if s.HasField("baseline"):
        rows.append(
            f'<tr class="baseline"><td>kiln reference</td><td>-</td>'
            f'<td>ok</td><td>yes</td><td class="num">{num(s.baseline.tokens_per_s)}</td>'
            f'<td class="num">{num(s.baseline.timing.median_ms, 3)}</td>'
            '<td class="num">-</td><td></td></tr>'
        )
    for b in view.baselines:
        note = b.skipped_reason or b.error
        rows.append(
            f'<tr class="baseline"><td>{e(b.name)}</td><td>{e(b.tier)}</td><td>{e(b.status)}</td>'
            f'<td>{"yes" if b.correct else "no"}</td><td class="num">{num(b.tokens_per_s)}</td>'
            f'<td class="num">{num(b.median_ms, 3)}</td>'
            f'<td class="num">{num(b.prefill_median_ms, 2)}</td>'
            f"<td><pre class='msg'>{e(note[:2000])}</pre></td></tr>"
        )
    if s.HasField("best"):
        m = s.best.measurement
        rows.append(
            f'<tr class="baseline"><td>kiln best</td><td>full</td><td>ok</td><td>yes</td>'
            f'<td class="num">{num(m.tokens_per_s)}</td>'
            f'<td class="num">{num(m.timing.median_ms, 3)}</td>'
            f'<td class="num">-</td><td>{s.best.speedup:.2f}x</td></tr>'
        )
    if not rows:
        return "<p class='note'>no baselines recorded (the default on cpu is none)</p>"
    headers = ("baseline", "tier", "status", "correct", "tok/s", "ms/step", "prefill ms", "note")
    return table(headers, rows, table_id="baselines")


def moves_html(view: CompilationView) -> str:
    """What each move of the confirmed best bought (fast tier), or why there is nothing."""
    effects = view.move_effects()
    if not effects:
        return "<p class='note' id='moves-note'>no confirmed best with moves yet</p>"
    rows = [
        f'<tr class="move"><td>{e(m.move)}</td>'
        f'<td class="num">{"-" if m.factor is None else f"{m.factor:.2f}x"}</td>'
        f"<td>{e(m.evidence)}</td><td class='num'>{num(m.without_tps)}</td>"
        f"<td class='num'>{num(m.with_tps)}</td></tr>"
        for m in effects
    ]
    note = (
        "<p class='note'>From the fast-tier results the search took: the best without the move "
        "(<i>without</i>), else the move alone over the reference (<i>alone</i>); "
        "<i>unmeasured</i> where neither was measured.</p>"
    )
    headers = ("move", "bought", "evidence", "without, tok/s", "with, tok/s")
    return table(headers, rows, table_id="moves") + note


def board_html(view: CompilationView) -> str:
    """The board's posts of this compilation (bodies are untrusted JSON text)."""
    if view.board_note:
        return f"<p class='note' id='board-note'>{e(view.board_note)}</p>"
    rows = [
        f'<tr class="post"><td class="num">{m.seq}</td><td>{e(m.kind)}</td><td>{e(m.agent)}</td>'
        f"<td>{e(m.candidate_id[:16])}</td><td>{e(m.posted_at)}</td>"
        f"<td><pre class='msg'>{e(m.body)}</pre></td></tr>"
        for m in view.board
    ]
    if not rows:
        return "<p class='note'>no posts</p>"
    return table(("seq", "kind", "agent", "candidate", "posted", "body"), rows, table_id="board")


def _body(view: CompilationView, filters: Mapping[str, str], *, live: bool) -> str:
    headers = (
        "experiment",
        "agent",
        "tier",
        "candidate",
        "status",
        "correct",
        "tok/s",
        "ms/step",
        "done at s",
    )
    n = len(view.experiments)
    exp_table = (
        f'<table id="experiments"><thead><tr>{"".join(f"<th>{e(h)}</th>" for h in headers)}'
        f'</tr></thead><tbody id="experiments-body">{experiment_rows(view, filters)}</tbody>'
        "</table>"
    )
    form = _filters_form(view, filters) if live else ""
    return (
        f"<h1>Compilation {e(view.compilation_id)}</h1>"
        f'<dl class="summary" id="summary">{summary_html(view)}</dl>'
        f'<h2>Best-so-far</h2><div id="plot">{plot_svg(view)}</div>'
        "<p class='note'>Search agents measure on the fast tier (a few layers), confirm on the "
        "full tier: lines of different tiers are not comparable. Dashed: the confirmed best.</p>"
        f"<h2>Baselines</h2>{baselines_html(view)}"
        f"<h2>What each move bought</h2>{moves_html(view)}"
        f"<h2>Experiments ({n})</h2>{form}{exp_table}"
        f"<h2>Board</h2>{board_html(view)}"
    )


def compilation_page(view: CompilationView, filters: Mapping[str, str], team: str) -> str:
    """The page of one compilation (polling itself while it runs)."""
    live = "" if view.ended else f"/api{comp_href(view.compilation_id)}"
    status = status_name(view.snapshot.status)
    return layout(
        f"kiln: {view.compilation_id}",
        _body(view, filters, live=True),
        team=team,
        live_url=live,
        status=status,
    )


def live_json(view: CompilationView) -> dict[str, Any]:
    """What the script swaps in: escaped fragments, the status, whether to stop polling."""
    return {
        "compilation_id": view.compilation_id,
        "status": status_name(view.snapshot.status),
        "ended": view.ended,
        "poll_ms": POLL_MS,
        "plot": plot_svg(view),
        "summary": summary_html(view),
        "experiments-body": experiment_rows(view, {}),
        "experiments": [x.as_dict() for x in view.experiments.values()],
        "curves": [{"name": c.name, "points": list(c.points)} for c in view.curves()],
    }


def report_html(view: CompilationView) -> str:
    """One self-contained HTML file of the compilation (no script, no external asset)."""
    made = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    body = _body(view, {}, live=False) + f"<p class='note'>kiln report, written {e(made)}.</p>"
    return layout(f"kiln report: {view.compilation_id}", body, script=False)
