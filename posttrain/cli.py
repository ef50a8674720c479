"""``posttrain`` command line. Commands validate params first: a bad config exits 2 with one line."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import NoReturn

import typer

from posttrain import __version__
from posttrain.config import EXIT_CONFIG_ERROR, ConfigError, Params, load_params, repo_root

app = typer.Typer(help="posttrain: a reproducible, versioned pipeline for LLM reasoning post-training.",
                  no_args_is_help=True, add_completion=False)

PARAMS = typer.Option(Path("params.yaml"), "--params", "-p", help="params file")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"posttrain {__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="print the version and exit")) -> None:
    """posttrain: a reproducible, versioned pipeline for LLM reasoning post-training."""


def _params(path: Path, root: Path | None = None, need_model: bool = True) -> Params:
    """The validated params, with every ``paths.*`` inside the repository (``root``; default the one holding
    the params file, :func:`config.repo_root`) and ``model.base`` importable here (``config.model.unavailable``);
    else one line and exit 2."""
    try:
        p = load_params(path)
    except ConfigError as e:
        print(f"posttrain: {e}", file=sys.stderr)
        raise typer.Exit(EXIT_CONFIG_ERROR) from None
    from posttrain.config.model import unavailable

    root = root or repo_root(path)
    if bad := p.paths.outside(root) or (need_model and unavailable(p.model.base, p.model.revision, root)):
        print(f"posttrain: {path}: {bad}", file=sys.stderr)
        raise typer.Exit(EXIT_CONFIG_ERROR)
    return p


def _die(message: str) -> NoReturn:
    """One line on stderr and exit 2 (a wrong argument, before any work)."""
    print(f"posttrain: {message}", file=sys.stderr)
    raise typer.Exit(EXIT_CONFIG_ERROR)


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
           cron: str = typer.Option("0 3 * * *", help="schedule of the nightly-evaluate deployment"),
           pools: str = typer.Option("cpu,gpu", help="whose deployments to make here: cpu (the pipeline's), gpu "
                                     "(the stage one, from the gpu machine's checkout) or both")) -> None:
    """Create the Prefect deployments (pipeline, nightly evaluate, gpu stage) on the server at PREFECT_API_URL.

    Runs `python -m flows.deploy` with this interpreter (the library never imports the flows): one `name: id`
    line per deployment, its exit code passed through."""
    import subprocess

    _params(repo / "params.yaml")
    chosen = tuple(p.strip() for p in pools.split(","))
    if not chosen or set(chosen) - {"cpu", "gpu"}:
        typer.echo(f"posttrain: --pools: cpu, gpu or cpu,gpu, got {pools!r}", err=True)
        raise typer.Exit(2)
    raise typer.Exit(subprocess.call([sys.executable, "-m", "flows.deploy", "--repo", str(repo), "--cron", cron,
                                      "--pools", ",".join(chosen)]))


tracking_app = typer.Typer(help="MLflow tracking: replay runs kept while the store was unreachable.",
                           no_args_is_help=True)
app.add_typer(tracking_app, name="tracking")


@tracking_app.command("sync")
def tracking_sync(params: Path = PARAMS) -> None:
    """Send every run waiting in the outbox (tracking.outbox) to the tracking store."""
    from posttrain import tracking

    p = _params(params)
    root = repo_root(params)
    box = tracking.outbox_dir(p, root)
    sent, left, refused = tracking.sync(box, tracking.store_uri(p, root), root)
    typer.echo(f"sent {sent} run(s); {left} left in {box}" + (f"; {refused} refused by the store, kept with their "
                                                               f"reason in {box / 'refused'}" if refused else ""))
    if left or refused:
        raise typer.Exit(1)


@app.command()
def plan(params: Path = PARAMS,
         model: str = typer.Option(None, help="a config.json or a model folder (default: paths.base_model, else "
                                              "model.base); benchmarks/model_configs/ has Qwen2.5-7B's and 1.5B's"),
         world: int = typer.Option(8, min=1, max=4096, help="ranks (one per GPU), FSDP2"),
         gpu_gib: float = typer.Option(80.0, min=1.0, help="memory of one GPU, GiB"),
         seq_len: int = typer.Option(None, min=8, help="tokens per sequence (default: 512 + rl.sampling."
                                                       "max_new_tokens)"),
         stages: str = typer.Option("sft,rl,distill", help="which trainers, comma-separated"),
         student: str = typer.Option(None, help="the distill student's config.json or folder (default: from "
                                                "distill.student; a hub id needs the hub)"),
         json_out: Path = typer.Option(None, "--json", help="also write the rows here")) -> None:
    """Per-rank peak memory of the sft, rl and distill updates at WORLD ranks of GPU_GIB, measured by running one
    update step of this code under torch's fake process group and fake tensors (FSDPMemTracker): no GPU, no
    weights. Says "fits" or what to change (docs/distributed.md, Memory plan)."""
    import json

    from posttrain import plan as memplan

    p = _params(params, need_model=False)  # a config is all the plan reads
    chosen = tuple(s.strip() for s in stages.split(",") if s.strip())
    if not chosen or set(chosen) - set(memplan.STAGES):
        _die(f"--stages: {stages!r}: choose from {', '.join(memplan.STAGES)}")
    source = model or (p.paths.base_model if Path(p.paths.base_model, "config.json").is_file() else p.model.base)
    try:
        config = memplan.load_config(source)
    except (OSError, ValueError, KeyError) as e:
        _die(f"--model: {source}: no model config there ({str(e).splitlines()[0]})")
    small = None
    if "distill" in chosen:
        try:
            small = memplan.student_config(config, student or p.distill.student)
        except (OSError, ValueError, KeyError) as e:
            _die(f"distill.student: {student or p.distill.student}: no model config here ({str(e).splitlines()[0]}); "
                 "pass --student CONFIG or --stages sft,rl")
    rows = memplan.plan(config, p, world, gpu_gib, seq_len or 512 + p.rl.sampling.max_new_tokens, chosen, small)
    typer.echo(memplan.table(rows, f"{source} on {world} x {gpu_gib:g} GiB, model.dtype {p.model.dtype}, "
                                   f"lora {'on' if p.model.lora else 'off'}"))
    if json_out:
        json_out.write_text(json.dumps(rows, indent=1) + "\n")


@app.command()
def repro(params: Path = PARAMS, args: list[str] = typer.Argument(None, help="passed to `dvc repro`, after "
                                                                       "`--` when they start with -: "
                                                                       "posttrain repro -- -s rl")) -> None:
    """`dvc repro` under one MLflow parent run: every stage run it starts is nested under it. One pipeline run
    per checkout (the flows' workspace lock). Ctrl-C or SIGTERM goes to dvc and the stage it runs (their own
    process group: the stage stops as it would alone, resumable), and the parent run ends KILLED; SIGKILLed, the
    next invocation on this host ends it so. The repository is the one holding dvc.yaml above the params file's
    directory; a params file other than its params.yaml (``-p profiles/code.yaml``) is what params.yaml reads
    for the run, the checkout's own text again after (``dvcrepo.use_params``, as a flow run does)."""
    import os
    import signal
    import subprocess

    from posttrain import tracking
    from posttrain.dvcrepo import clear_stale_locks, use_params, workspace_lock
    from posttrain.errors import StageError

    root = repo_root(params)
    p = _params(params, root)
    own = (root / "params.yaml").resolve() == params.resolve()
    try:
        with workspace_lock(root, "posttrain repro", p.prefect.workspace_wait_s), \
                use_params(root, None if own else params.read_text()):
            clear_stale_locks(root)  # left by a killed run
            parent = tracking.start_parent(p, root, "pipeline", {"launcher": "posttrain repro"})
            # the stages' `python` is the one posttrain runs in (`.venv/bin/posttrain repro` with nothing
            # activated ran them on the system python: "No module named 'transformers'")
            env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
            if parent:
                env[tracking.PARENT_ENV] = parent
            proc = subprocess.Popen([sys.executable, "-m", "dvc", "repro", *(args or [])], cwd=root, env=env,
                                    process_group=0)
            got: list[int] = []

            def forward(signum: int, _: object) -> None:
                got.append(signum)
                os.killpg(proc.pid, signum)

            handlers = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                rc = proc.wait()
            finally:
                for s, h in handlers.items():
                    signal.signal(s, h)
            tracking.end_parent(p, root, parent, "FINISHED" if rc == 0 else "KILLED" if got else "FAILED")
    except StageError as e:  # the workspace is held by another run
        print(f"posttrain: {e}", file=sys.stderr)
        raise typer.Exit(1) from None
    except ConfigError as e:  # the tracking store refuses this checkout (moved)
        _die(str(e))
    raise typer.Exit(rc if rc >= 0 else 128 - rc)  # dvc killed by a signal: 128 + its number, as a shell says


@app.command()
def compare(a: str = typer.Argument(..., help="a git revision or DVC experiment name (the baseline)"),
            b: str = typer.Argument(..., help="a git revision or DVC experiment name"),
            as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
            repo: Path = typer.Option(Path("."), help="repository root")) -> None:
    """B against A: paired differences with 95% intervals on the same problems for every evaluated model, and
    which params and stage outputs differ (posttrain/compare.py)."""
    import dataclasses
    import json as _json

    from posttrain import compare as C
    from posttrain.errors import StageError

    try:
        c = C.compare(repo.resolve(), a, b)
    except StageError as e:
        print(f"posttrain compare: {e}", file=sys.stderr)
        raise typer.Exit(2) from None
    typer.echo(_json.dumps(dataclasses.asdict(c), indent=2) if as_json else C.markdown(c, a, b))


@app.command()
def lineage(target: str = typer.Argument(..., help="a DVC output path (or a file in one), or models:/<name>/<v> "
                                         "or models:/<name>@<alias>"),
            verify: bool = typer.Option(False, "--verify", help="recompute hashes; exit 1 on any mismatch"),
            as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
            samples: bool = typer.Option(False, "--samples", help="the sample ledger of the stage that trained the "
                                         "model (rl, sft, distill) instead: which curated rows each step "
                                         "consumed, in order (posttrain/lineage/ledger.py)"),
            params: Path = PARAMS) -> None:
    """Where TARGET came from: every stage back to the sources, with params, hashes, runs, metrics."""
    import json as _json

    from rich.console import Console

    from posttrain import lineage as L
    from posttrain import tracking
    from posttrain.errors import StageError
    from posttrain.lineage.check import verify as verify_tree

    p = _params(params)
    root = repo_root(params)
    if samples:
        from posttrain.lineage.ledger import distill_ledger, ledger, sft_ledger

        trained = {"rl": p.paths.rl_model, "sft": p.paths.sft_model, "student": p.paths.student_model,
                   "student_sft": p.paths.student_sft_model}
        kind = {(root / m).resolve(): k for k, m in trained.items()}.get((root / target).resolve())
        if kind is None:
            print(f"posttrain lineage: --samples: {target} is none of the trained models ("
                  + ", ".join(trained.values()) + "); only their stages record the rows each step consumed",
                  file=sys.stderr)
            raise typer.Exit(2)
        led = {"rl": lambda: ledger(root, p), "sft": lambda: sft_ledger(root, p),
               "student": lambda: distill_ledger(root, p), "student_sft": lambda: sft_ledger(root, p, True)}[kind]()
        if as_json:
            typer.echo(_json.dumps(led, indent=2))
        else:
            typer.echo(f"curated split {led['split']['path']} sha256 {led['split']['sha256']}")
            for s in led["steps"]:
                if kind == "rl":
                    typer.echo(f"step {s['step']}: {s['samples']} samples, {s['used']} used, prompts "
                               + " ".join(s["prompts"]))
                else:  # sft: id:rendering; distill: its phase, then id:sampler
                    phase = f" ({s['phase']})" if kind == "student" else ""
                    tags = s["samplers"] if kind == "student" else s["styles"]
                    typer.echo(f"step {s['step']}{phase}: " + " ".join(f"{i}:{x}" for i, x in zip(s["ids"], tags,
                                                                                                strict=True)))
        return
    uri = tracking.store_uri(p, root) if p.tracking.enabled else None
    try:
        tree = L.trace(root, target, p.paths.metrics_dir, uri)
    except StageError as e:
        print(f"posttrain lineage: {e}", file=sys.stderr)
        raise typer.Exit(2) from None
    problems = verify_tree(root, tree) if verify else []
    used_by = L.consumers(root, target) if not target.startswith("models:/") else []
    if as_json:
        typer.echo(_json.dumps({"target": target, "tree": tree.to_dict(), "consumed_by": used_by,
                                "verified": verify, "problems": problems}, indent=2))
    else:
        con = Console()
        from posttrain.lineage.render import tree_view

        if tree.at is not None:
            from posttrain.revisions import describe

            con.print(f"traced in the dvc.lock of {describe(root, tree.at)}, not the workspace's: "
                      "--verify checks the bytes DVC's cache (and git) keep for it")
        con.print(tree_view(tree, verify))
        if used_by:
            con.print(f"consumed by (downstream of {target}): {', '.join(used_by)}")
        if verify:
            con.print("[green]verify: every hash matches dvc.lock[/green]" if not problems else
                      "[red]verify FAILED:[/red]\n  " + "\n  ".join(problems))
    if problems:
        raise typer.Exit(1)


@app.command()
def version() -> None:
    """Print the posttrain version."""
    typer.echo(__version__)


if __name__ == "__main__":
    app()
