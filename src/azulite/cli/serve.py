"""``azulite serve ...`` (placeholder: the serving issue fills this in)."""

import typer


def register(app: typer.Typer) -> None:
    """Adds the ``serve`` command to the top-level app."""
