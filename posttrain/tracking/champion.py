"""The model registry: a version per model output (linked to its run, DVC md5 and parent version), the
``candidate`` alias on every new version, and the ``champion`` alias moved by evaluation when a version's
``tracking.champion`` metric beats the current champion's."""

from __future__ import annotations

from typing import Any


def register(client: Any, m: dict[str, Any], run_id: str) -> str:
    """A model version for the folder ``m['source']``, linked to its run, DVC md5 and parent version."""
    from mlflow.exceptions import MlflowException

    try:
        client.create_registered_model(m["name"])
    except MlflowException:
        pass  # exists
    parent = find_version_by_md5(client, m["parent_md5"]) if m.get("parent_md5") else None
    tags = {"dvc_md5": m["md5"], "run_id": run_id,
            "parent_version": f"{parent.name}/{parent.version}" if parent else ""}
    mv = client.create_model_version(m["name"], source=m["source"], run_id=run_id, tags=tags)
    client.set_registered_model_alias(m["name"], "candidate", mv.version)
    return mv.version


def promote(client: Any, e: dict[str, Any]) -> bool:
    """Tag the evaluated version with its metric; move ``champion`` to it if it beats the current one."""
    from mlflow.exceptions import MlflowException

    mv = find_version_by_md5(client, e["md5"])
    if mv is None:
        return False  # not a registered model (base, or an older checkpoint)
    client.set_model_version_tag(mv.name, mv.version, e["metric"], str(e["value"]))
    try:
        champ = client.get_model_version_by_alias(mv.name, "champion")
        best = float(champ.tags.get(e["metric"], "-inf"))
    except MlflowException:
        best = float("-inf")
    if e["value"] > best:
        client.set_registered_model_alias(mv.name, "champion", mv.version)
        return True
    return False


def find_version_by_md5(client: Any, md5: str) -> Any:
    """The newest registered model version whose ``dvc_md5`` tag is ``md5`` (None if none)."""
    found = client.search_model_versions(f"tags.dvc_md5 = '{md5}'")
    return max(found, key=lambda v: int(v.version)) if found else None
