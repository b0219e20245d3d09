"""The ``kiln`` console script (kiln.cli.launch:main): the CLI in a full install, one line naming
the ``server`` extra where the CLI's dependencies are missing (a client-only install; the real
one is tests/integration/test_client_install.py)."""

from __future__ import annotations

import sys

import pytest

import kiln.cli.main  # noqa: F401  (in sys.modules, so the test below can take it out)
from kiln.cli.launch import SERVER_EXTRA_HINT, main


def test_the_console_script_runs_the_cli(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "argv", ["kiln", "--help"])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 0
    assert "Usage: kiln" in capsys.readouterr().out


def test_without_the_server_extra_it_says_which_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delitem(sys.modules, "kiln.cli.main")
    monkeypatch.setitem(sys.modules, "typer", None)  # import typer: ModuleNotFoundError
    monkeypatch.setattr(sys, "argv", ["kiln", "--help"])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"kiln: the command line needs the server extra (typer is not installed): "
        f"{SERVER_EXTRA_HINT}"
    ]


def test_a_missing_kiln_module_is_not_hidden(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "kiln.cli.main", None)
    with pytest.raises(ModuleNotFoundError):
        main()
