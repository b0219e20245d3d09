"""The ``kiln`` command line (typer + rich); the app is :data:`kiln.cli.main.app`."""
