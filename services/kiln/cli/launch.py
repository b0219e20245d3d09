"""The ``kiln`` console script: the CLI (:data:`kiln.cli.main.app`), or, in a client-only install
(``pip install kiln``: the gRPC stubs and :mod:`kiln.common.client`, without the servers'
dependencies), one line saying which extra the CLI needs instead of a traceback."""

from __future__ import annotations

import sys

SERVER_EXTRA_HINT = "pip install 'kiln[server]'"


def main() -> None:
    """Run the CLI; exit 1 with a hint when a dependency of the ``server`` extra is missing."""
    try:
        from kiln.cli.main import app
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").partition(".")[0]
        if not missing or missing == "kiln":
            raise
        print(
            f"kiln: the command line needs the server extra ({missing} is not installed): "
            f"{SERVER_EXTRA_HINT}",
            file=sys.stderr,
        )
        raise SystemExit(1) from None
    app()
