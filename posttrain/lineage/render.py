"""``posttrain lineage``'s tree on the terminal: one rich node per stage, its outs (verified or not), MLflow run,
key metrics, decontamination verdict, origin, pinned inputs, params naming outputs, and the Slurm job or image it
ran as."""

from __future__ import annotations

from rich.tree import Tree

from posttrain.lineage import Node, origin_line


def tree_view(tree: Node, verified: bool) -> Tree:
    """A rich Tree of a lineage (``posttrain.lineage.trace``): one node per stage, its outs, run, metrics."""
    def label(n: Node) -> str:
        run = f"run {n.run_id[:12]} @ {n.commit[:10] if n.commit else '?'}" if n.run_id else "no MLflow run"
        lines = [f"[bold]{n.stage}[/bold]  params {n.params_digest}  {run}"]
        for o in n.outs:
            mark = "" if not verified else (" [green]ok[/green]" if not o.problem else f" [red]{o.problem}[/red]")
            lines.append(f"  {o.path}  {o.md5[:12]}{mark}")
        if n.metrics:
            shown = list(n.metrics.items())[:6]
            lines.append("  metrics: " + ", ".join(f"{k}={v}" for k, v in shown))
        if n.verdict:
            lines.append(f"  decontamination: {n.verdict}")
        if n.origin:
            lines.append(f"  origin: {origin_line(n.origin)}")
        if n.pins:
            lines.append("  inputs: " + ", ".join(f"{k}={'unpinned' if v is None else v}" for k, v in n.pins.items()))
        if n.refs:
            lines.append("  params naming outputs: " + ", ".join(f"{k}={v}" for k, v in n.refs.items()))
        j = n.ran_as
        if "slurm.job_id" in j:
            lines.append(f"  slurm job {j['slurm.job_id']} on {j.get('slurm.nodes')} (restarts "
                         f"{j.get('slurm.restarts', '0')}; slurm {j.get('slurm.version') or '?'}, cuda "
                         f"{j.get('cuda', '?')})")
        if "container.image" in j or "container.engine" in j:
            lines.append(f"  image {j.get('container.image', '?')}"
                         + (f" (id {j['container.imageid'][:19]})" if "container.imageid" in j else "")
                         + (f" on {j['container.engine']}" if "container.engine" in j else ""))
        return "\n".join(lines)

    seen: set[str] = set()

    def add(t: Tree, n: Node) -> None:
        if n.stage in seen:
            t.add(f"[dim]{n.stage} (above)[/dim]")
            return
        seen.add(n.stage)
        sub = t.add(label(n))
        for p in n.parents:
            add(sub, p)
        data = [s for s in n.sources if not s.endswith(".py") and not s.startswith("posttrain/")]
        code = len(n.sources) - len(data)
        if data or code:
            sub.add(f"[dim]sources: {', '.join(data) + ('; ' if data else '')}{code} code files[/dim]")

    root = Tree("lineage")
    add(root, tree)
    return root
