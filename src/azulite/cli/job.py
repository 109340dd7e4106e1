"""``azulite job ...`` (placeholder: the foundation issue fills this in)."""

import typer

app = typer.Typer(no_args_is_help=True, help="Submit, watch and cancel training jobs.")
