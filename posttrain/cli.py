"""``posttrain`` command line. Commands validate params first: a bad config exits 2 with one line."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from posttrain import __version__
from posttrain.config import EXIT_CONFIG_ERROR, ConfigError, Params, load_params

app = typer.Typer(help="posttrain: a reproducible, versioned pipeline for LLM reasoning post-training.",
                  no_args_is_help=True, add_completion=False)

PARAMS = typer.Option(Path("params.yaml"), "--params", "-p", help="params file")


def _params(path: Path) -> Params:
    try:
        return load_params(path)
    except ConfigError as e:
        print(f"posttrain: {e}", file=sys.stderr)
        raise typer.Exit(EXIT_CONFIG_ERROR) from None


@app.command()
def validate(params: Path = PARAMS) -> None:
    """Check params.yaml (unknown keys, types, ranges, input files) without running anything."""
    p = _params(params)
    typer.echo(f"{params}: ok (task {p.task.kind}, model {p.model.base})")


@app.command()
def unlock(repo: Path = typer.Option(Path("."), help="DVC repository root")) -> None:
    """Clear DVC run locks left by a killed `dvc repro` (only entries whose process is gone)."""
    from posttrain.dvcrepo import clear_stale_locks

    freed = clear_stale_locks(repo)
    typer.echo(f"unlocked {len(freed)} path(s)" + "".join(f"\n  {p}" for p in freed))


@app.command()
def deploy(repo: Path = typer.Option(Path("."), help="repository whose flows the workers run"),
           cron: str = typer.Option("0 3 * * *", help="schedule of the nightly-evaluate deployment")) -> None:
    """Create the Prefect deployments (pipeline, nightly evaluate, gpu stage) on the server at PREFECT_API_URL."""
    _params(repo / "params.yaml")
    from flows.deploy import deploy as _deploy

    for name, i in zip(["posttrain-pipeline/default", "posttrain-pipeline/nightly-evaluate", "posttrain-stage/gpu"],
                       _deploy(repo, cron), strict=True):
        typer.echo(f"{name}: {i}")


@app.command()
def version() -> None:
    """Print the posttrain version."""
    typer.echo(__version__)


if __name__ == "__main__":
    app()
