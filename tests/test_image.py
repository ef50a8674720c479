"""The worker image (``Containerfile``, ``make image``): stages run inside it with podman on a checkout mounted from
the host, and their MLflow runs and ``posttrain lineage`` name the image. Building it takes ~10 minutes and ~7 GB
(PyPI's CUDA torch), so the test runs only on an image already built: ``POSTTRAIN_TEST_IMAGE`` names it (e.g.
``localhost/posttrain-worker:<commit>``); ``POSTTRAIN_PODMAN`` is the command with its global and run options (on a
VM whose cgroups crun refuses: ``podman --runtime runc`` and ``POSTTRAIN_PODMAN_RUN`` = ``--ulimit nofile=...``)."""

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO, tiny_raw

IMAGE = os.environ.get("POSTTRAIN_TEST_IMAGE")
pytestmark = [pytest.mark.slow, pytest.mark.extended,
              pytest.mark.skipif(not IMAGE, reason="POSTTRAIN_TEST_IMAGE unset: build one with `make image`")]


def test_curate_and_sft_run_inside_the_image_and_their_runs_and_lineage_name_it(tmp_path):
    podman = shlex.split(os.environ.get("POSTTRAIN_PODMAN", "podman"))
    digest = subprocess.run([*podman, "image", "inspect", "--format", "{{.Digest}}", IMAGE], capture_output=True,
                            text=True, check=True).stdout.strip()
    ref = f"{IMAGE.rsplit(':', 1)[0]}@{digest}"
    repo = tmp_path / "repo"
    subprocess.run(["git", "clone", "-q", str(REPO), str(repo)], check=True)
    raw = tiny_raw(None)
    raw["tracking"]["enabled"] = True
    (repo / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    r = subprocess.run([*podman, "run", "--rm", *shlex.split(os.environ.get("POSTTRAIN_PODMAN_RUN", "")),
                        "-v", f"{repo}:{repo}", "-w", str(repo), "-e", "HF_HUB_OFFLINE=1", "-e",
                        f"POSTTRAIN_IMAGE={ref}", IMAGE, "dvc", "repro", "sft"], capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    lineage = subprocess.run([sys.executable, "-m", "posttrain.cli", "lineage", "models/sft", "--json"], cwd=repo,
                             capture_output=True, text=True, timeout=300)
    assert lineage.returncode == 0, lineage.stderr[-3000:]
    import json

    tree = json.loads(lineage.stdout)["tree"]
    stages = [tree, *tree["parents"]]
    assert {n["stage"] for n in stages} == {"sft", "curate", "model"}
    assert all(n["ran_as"]["container.image"] == ref for n in stages)
    assert Path(repo / "models" / "sft" / "model.safetensors").is_file()
