"""PNG copies of the report's plots, drawn by a headless chromium when one is installed
(no Python imaging dependency): each SVG is put in a bare page and screenshotted.

:func:`write_pngs` raises :class:`PngUnavailable` (one line) when no browser is found or it
fails; ``KILN_CHROMIUM`` names the browser binary, else ``chromium``/``chromium-browser``/
``google-chrome`` on PATH.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

BROWSERS = ("chromium", "chromium-browser", "google-chrome")

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
)
"""Browser flags: no sandbox (containers, root), no network of its own."""


class PngUnavailable(RuntimeError):
    """PNGs cannot be written here (no browser, or it failed)."""


def find_browser() -> str | None:
    """The headless browser's path, or None."""
    given = os.environ.get("KILN_CHROMIUM")
    if given:
        return given if Path(given).is_file() else None
    return next((p for b in BROWSERS if (p := shutil.which(b))), None)


def _size(svg: str) -> tuple[int, int]:
    m = re.search(r'width="(\d+)" height="(\d+)"', svg)
    return (int(m.group(1)), int(m.group(2))) if m else (720, 320)


def write_pngs(plots: dict[str, str], out_dir: Path, timeout_s: float = 60.0) -> list[Path]:
    """Write each ``name -> svg`` as ``out_dir/<name>.png``; returns the paths.

    Raises:
        PngUnavailable: no browser, or it failed or wrote nothing.
    """
    browser = find_browser()
    if browser is None:
        raise PngUnavailable(
            "PNG plots need a headless chromium (apt-get install chromium, or set "
            "KILN_CHROMIUM); the HTML report has the same plots as SVG"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    with tempfile.TemporaryDirectory(prefix="kiln-png-") as tmp:
        for name, svg in plots.items():
            width, height = _size(svg)
            page = Path(tmp) / f"{name}.html"
            page.write_text(
                '<!doctype html><html><body style="margin:0">' + svg + "</body></html>",
                encoding="utf-8",
            )
            target = (out_dir / f"{name}.png").resolve()
            target.unlink(missing_ok=True)  # an older plot there must not pass for this one
            cmd = [
                browser,
                *FLAGS,
                f"--user-data-dir={Path(tmp) / 'profile'}",
                f"--window-size={width},{height}",
                f"--screenshot={target}",
                page.as_uri(),
            ]
            try:
                subprocess.run(cmd, capture_output=True, timeout=timeout_s, check=False)
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise PngUnavailable(f"{browser} failed: {exc}") from None
            if not target.is_file() or not target.read_bytes().startswith(b"\x89PNG"):
                raise PngUnavailable(f"{browser} wrote no screenshot for {name}")
            written.append(target)
    return written
