"""Browser tests: a real headless chromium (Debian's ``chromium``) loads the dashboard. They carry
the ``browser`` marker (registered here too, so a checkout without it in pyproject still runs
them) and skip with a reason when chromium is absent."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .cdp import CHROMIUM, Browser, available


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "browser: drives a real headless chromium")


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """One headless chromium for the module."""
    if not available():
        pytest.skip(f"no chromium at {CHROMIUM} (apt-get install -y chromium)")
    b = Browser()
    try:
        yield b
    finally:
        b.close()
