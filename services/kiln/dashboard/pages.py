"""The dashboard's HTML: the page frame and the list pages (compilations, deployments), the
login and error pages. Every value from a service is escaped with :func:`e` (board posts,
errors and names are untrusted text); pages load one script, ``/static/dashboard.js``."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from html import escape
from urllib.parse import quote

from kiln.dashboard.assets import CSS
from kiln.dashboard.view import status_name
from kiln.v1 import compiler_pb2, deployments_pb2

DEPLOYMENT_STATUS = {
    deployments_pb2.DEPLOYMENT_STATUS_CREATING: "creating",
    deployments_pb2.DEPLOYMENT_STATUS_ACTIVE: "active",
    deployments_pb2.DEPLOYMENT_STATUS_RECOMPILING: "recompiling",
    deployments_pb2.DEPLOYMENT_STATUS_FAILED: "failed",
}


def e(value: object) -> str:
    """``value`` as HTML text (quotes escaped too: safe in attributes)."""
    return escape(str(value), quote=True)


def num(value: float, digits: int = 1) -> str:
    """A number with thousands separators, or "-" for 0."""
    return f"{value:,.{digits}f}" if value else "-"


def link(href: str, text: str) -> str:
    """An ``<a>`` to a dashboard path (``href`` already quoted by the caller)."""
    return f'<a href="{e(href)}">{e(text)}</a>'


def comp_href(compilation_id: str) -> str:
    """The dashboard path of one compilation."""
    return "/compilations/" + quote(compilation_id, safe="")


def table(headers: Sequence[str], rows: Iterable[str], *, table_id: str = "") -> str:
    """A table of already-rendered ``<tr>`` rows."""
    ident = f' id="{e(table_id)}"' if table_id else ""
    head = "".join(f"<th>{e(h)}</th>" for h in headers)
    return f"<table{ident}><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def layout(
    title: str,
    body: str,
    *,
    team: str = "",
    live_url: str = "",
    status: str = "",
    script: bool = True,
) -> str:
    """A whole page: inline CSS, the nav bar, ``body`` (already escaped HTML); with ``script``
    it loads ``/static/dashboard.js``; ``live_url`` makes that script poll it."""
    live = f' data-live="{e(live_url)}"' if live_url else ""
    stat = f' data-status="{e(status)}"' if status else ""
    js = '<script src="/static/dashboard.js" defer></script>' if script else ""
    who = f'<span class="who">team {e(team)}</span>' if team else ""
    nav = (
        '<header><strong>kiln</strong><a href="/">compilations</a>'
        f'<a href="/deployments">deployments</a>{who}</header>'
        if script
        else ""
    )
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{e(title)}</title><style>{CSS}</style>{js}</head>"
        f"<body{live}{stat}>{nav}<main>{body}</main></body></html>"
    )


def compilations_page(comps: Sequence[compiler_pb2.Compilation], team: str) -> str:
    """Every compilation the team may see, newest first."""
    rows = []
    for c in comps:
        status = status_name(c.status)
        best = c.best.measurement.tokens_per_s if c.HasField("best") else 0.0
        speedup = f"{c.best.speedup:.2f}x" if c.HasField("best") else "-"
        hw = c.workload.hardware
        hardware = hw.name + (f" x{hw.num_devices}" if hw.num_devices > 1 else "")
        created = (
            c.created_at.ToDatetime().strftime("%Y-%m-%d %H:%M") if c.created_at.seconds else ""
        )
        rows.append(
            f'<tr class="comp" data-status="{e(status)}">'
            f"<td>{link(comp_href(c.compilation_id), c.compilation_id)}</td>"
            f'<td class="status-{e(status)}">{e(status)}</td><td>{e(c.outcome or "-")}</td>'
            f"<td>{e(c.workload.model.name)}</td><td>{e(hardware)}</td>"
            f'<td class="num">{num(best)}</td><td class="num">{e(speedup)}</td>'
            f'<td class="num">{c.experiments_done}</td><td>{e(created)}</td></tr>'
        )
    headers = (
        "id",
        "status",
        "outcome",
        "model",
        "hardware",
        "best tok/s",
        "speedup",
        "experiments",
        "created (UTC)",
    )
    body = f"<h1>Compilations</h1><p class='note'>{len(comps)} compilation(s) of team {e(team)}."
    body += " Best tok/s is on the full tier (confirmed).</p>"
    body += table(headers, rows, table_id="compilations") if comps else "<p>none yet</p>"
    return layout("kiln: compilations", body, team=team)


def deployments_page(deps: Sequence[deployments_pb2.Deployment], team: str) -> str:
    """The team's deployments with their active candidate and last drift."""
    rows = []
    for d in deps:
        status = DEPLOYMENT_STATUS.get(d.status, "unknown")
        comps = " ".join(link(comp_href(c), c[:18]) for c in d.compilation_ids[-5:])
        drift = (
            f"{d.last_drift.score:.2f} ({d.last_drift.dominant})" if d.last_drift.reason else "-"
        )
        rows.append(
            f'<tr class="dep"><td>{e(d.name)}</td><td>{e(status)}</td>'
            f"<td>{e(d.model.name)}</td><td>{e(d.hardware.name)}</td>"
            f"<td>{e(d.active_candidate_id[:16] or '-')}</td>"
            f'<td class="num">{num(d.active_tokens_per_s)}</td>'
            f'<td class="num">{d.windows_observed}</td><td>{e(drift)}</td>'
            f'<td class="num">{d.recompilations}</td><td>{comps or "-"}</td></tr>'
        )
    headers = (
        "name",
        "status",
        "model",
        "hardware",
        "active candidate",
        "active tok/s",
        "windows",
        "last drift",
        "recompilations",
        "compilations",
    )
    body = "<h1>Deployments</h1>"
    body += table(headers, rows, table_id="deployments") if deps else "<p>none yet</p>"
    return layout("kiln: deployments", body, team=team)


def login_page(message: str = "") -> str:
    """The form that asks for the dashboard's token (non-loopback listeners)."""
    note = f'<p class="status-failed">{e(message)}</p>' if message else ""
    body = (
        "<h1>kiln dashboard</h1><p>This dashboard asks for its access token (printed by "
        "<code>kiln dashboard</code>, or the value of <code>KILN_DASHBOARD_TOKEN</code>).</p>"
        f'{note}<form method="post" action="/login"><label>token <input type="password" '
        'name="token" autocomplete="current-password" autofocus></label> '
        '<button type="submit">open</button></form>'
    )
    return layout("kiln: sign in", body, script=False)


def error_page(status: int, message: str) -> str:
    """A 4xx/5xx page with one line."""
    body = f"<h1>{status}</h1><p>{e(message)}</p><p><a href='/'>compilations</a></p>"
    return layout(f"kiln: {status}", body, script=False)
