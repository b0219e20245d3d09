"""The dashboard's only static assets, inline in the package: one stylesheet and one script.

The script (served at ``/static/dashboard.js``, never inline, so the pages' Content-Security-
Policy can forbid inline script) does two things: filters the experiments table by the status,
tier and agent selects (rows carry ``data-status``/``data-tier``/``data-agent``), and, on a
running compilation's page, polls ``/api/compilations/<id>`` every few seconds and swaps in the
server-rendered (escaped) plot, summary and table until the compilation ends.
"""

from __future__ import annotations

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:0;
color:#222;background:#fafafa}
header{background:#222;color:#eee;padding:8px 16px;display:flex;gap:16px;align-items:center}
header a{color:#eee;text-decoration:none}header a:hover{text-decoration:underline}
header .who{margin-left:auto;font-size:12px;color:#aaa}
main{padding:12px 16px;max-width:1200px}
h1{font-size:20px;margin:8px 0}h2{font-size:16px;margin:18px 0 6px}
table{border-collapse:collapse;font-size:13px;background:#fff}
th,td{border:1px solid #ddd;padding:3px 7px;text-align:left;vertical-align:top}
th{background:#f0f0f0}td.num{text-align:right;font-variant-numeric:tabular-nums}
tr.bad td{color:#a00}.muted{color:#777}.note{color:#555;font-size:13px}
.status-running{color:#06c}.status-succeeded{color:#070}.status-failed{color:#a00}
.status-cancelled{color:#a60}
dl.summary{display:grid;grid-template-columns:max-content auto;gap:2px 12px;font-size:13px}
dl.summary dt{color:#555}dl.summary dd{margin:0}
form.filters{margin:6px 0;font-size:13px}form.filters label{margin-right:10px}
details summary{cursor:pointer}pre.msg{white-space:pre-wrap;word-break:break-all;margin:0;
font-size:12px;max-width:640px}
.plot{border:1px solid #ddd;background:#fff}
"""

JS = r"""
(function () {
  "use strict";
  function applyFilters() {
    var table = document.getElementById("experiments");
    if (!table) { return; }
    var want = {};
    ["status", "tier", "agent"].forEach(function (k) {
      var el = document.getElementById("f-" + k);
      want[k] = el ? el.value : "";
    });
    var rows = table.querySelectorAll("tbody tr.exp");
    var shown = 0;
    rows.forEach(function (row) {
      var ok = ["status", "tier", "agent"].every(function (k) {
        return !want[k] || row.getAttribute("data-" + k) === want[k];
      });
      row.hidden = !ok;
      var detail = document.getElementById("phases-" + row.getAttribute("data-id"));
      if (detail) { detail.hidden = !ok; }
      if (ok) { shown += 1; }
    });
    var count = document.getElementById("exp-count");
    if (count) { count.textContent = shown + " of " + rows.length + " shown"; }
  }
  function poll(url) {
    fetch(url, {credentials: "same-origin", headers: {"Accept": "application/json"}})
      .then(function (r) { return r.ok ? r.json() : null; })
      .then(function (data) {
        if (!data) { return; }
        ["plot", "summary", "experiments-body"].forEach(function (id) {
          var el = document.getElementById(id);
          if (el && typeof data[id] === "string") { el.innerHTML = data[id]; }
        });
        document.body.setAttribute("data-status", data.status);
        document.body.setAttribute("data-polls",
          String(Number(document.body.getAttribute("data-polls") || "0") + 1));
        applyFilters();
        if (!data.ended) { setTimeout(function () { poll(url); }, data.poll_ms || 2000); }
      })
      .catch(function () { setTimeout(function () { poll(url); }, 5000); });
  }
  document.addEventListener("DOMContentLoaded", function () {
    ["status", "tier", "agent"].forEach(function (k) {
      var el = document.getElementById("f-" + k);
      if (el) { el.addEventListener("change", applyFilters); }
    });
    var form = document.querySelector("form.filters");
    if (form) {
      form.addEventListener("submit", function (e) { e.preventDefault(); applyFilters(); });
    }
    applyFilters();
    var live = document.body.getAttribute("data-live");
    if (live) { setTimeout(function () { poll(live); }, 1000); }
    document.body.setAttribute("data-js", "ready");
  });
})();
"""
