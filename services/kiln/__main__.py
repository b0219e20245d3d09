"""``python -m kiln``: the ``kiln`` command line (how ``kiln up`` starts each service)."""

from kiln.cli.main import app

if __name__ == "__main__":
    app(prog_name="kiln")
