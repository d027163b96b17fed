"""``kiln k8s render [VALUES]``: the manifests of a deployment of every registered stage, as one YAML stream."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(help="Kubernetes manifests (Deployments, KEDA ScaledObjects, spare-CPU DaemonSets).",
                  no_args_is_help=True)


@app.command()
def render(values: Annotated[Path | None, typer.Argument(help="A values YAML (infra/k8s/values.yaml documents "
                                                               "every field); default: the defaults.")] = None,
           out: Annotated[Path | None, typer.Option(help="Write here instead of standard output.")] = None) -> None:
    """Render; pipe into ``kubectl apply -f -``."""
    import yaml

    from kiln.streams.k8s.render import render as render_manifests
    from kiln.streams.k8s.values import Values
    from kiln.streams.stage import stage_specs

    chosen = Values.model_validate(yaml.safe_load(values.read_text()) or {}) if values else Values()
    text = yaml.safe_dump_all(render_manifests(chosen, list(stage_specs().values())), sort_keys=False)
    if out:
        out.write_text(text)
    else:
        typer.echo(text, nl=False)
