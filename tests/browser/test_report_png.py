"""``kiln compilations report --png``: the plots as PNG, drawn by headless chromium
(kiln.dashboard.png); without a browser, one line and exit 1."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from kiln.cli.main import app
from kiln.dashboard.png import PngUnavailable, write_pngs
from kiln.dashboard.svg import Series, step_plot

from .cdp import CHROMIUM, available


@pytest.mark.browser
def test_plots_become_pngs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if not available():
        pytest.skip(f"no chromium at {CHROMIUM} (apt-get install -y chromium)")
    monkeypatch.setenv("KILN_CHROMIUM", CHROMIUM)
    svg = step_plot([Series("a", ((1.0, 10.0), (4.0, 30.0)))], width=400, height=200)
    [path] = write_pngs({"best_so_far": svg}, tmp_path / "png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (400, 200)


def test_without_a_browser_png_is_one_line_and_exit_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KILN_CHROMIUM", str(tmp_path / "no-such-browser"))
    with pytest.raises(PngUnavailable, match="headless chromium"):
        write_pngs({"x": "<svg/>"}, tmp_path)
    result = CliRunner().invoke(
        app,
        ["compilations", "report", "c1", "--out", str(tmp_path / "r.html"), "--png", "d"],
    )
    assert result.exit_code == 1
    assert "--png needs a headless chromium" in result.output
    assert "Traceback" not in result.output
