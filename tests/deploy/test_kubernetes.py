"""The Kubernetes manifests in deploy/kubernetes, checked offline (no cluster can run here):
every resource against the Kubernetes API schemas, every setting against the code it configures,
and the security posture of each workload. `kubectl kustomize`, where installed, renders the
overlays too; the rest needs no tool but the schemas."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import typer.main
import yaml

from aenv.cli.main import app as cli_app
from aenv.config import Config

ROOT = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
KUBERNETES = "1.30.0"
Doc = dict[str, Any]


def kustomization(folder: Path) -> Doc:
    data: Doc = yaml.safe_load((folder / "kustomization.yaml").read_text())
    return data


def load(path: Path) -> list[Doc]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def resources(folder: Path) -> Iterator[tuple[Path, Doc]]:
    """The full resources a kustomization lists (not its patches), following bases."""
    for entry in kustomization(folder).get("resources", []):
        path = (folder / entry).resolve()
        if path.is_dir():
            yield from resources(path)
        else:
            for doc in load(path):
                yield path, doc


FOLDERS = [ROOT / "base", *sorted((ROOT / "overlays").iterdir())]


def name(doc: Doc) -> str:
    return f"{doc['kind']}/{doc['metadata']['name']}"


# Each resource once, though every overlay lists the base again.
ALL = list({(path, name(doc)): (path, doc) for f in FOLDERS for path, doc in resources(f)}.values())


def containers(doc: Doc) -> list[Doc]:
    spec = doc.get("spec", {}).get("template", {}).get("spec", {})
    found: list[Doc] = spec.get("containers", [])
    return found


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda f: f.name)
def test_every_file_of_a_folder_is_listed(folder: Path) -> None:
    listed = kustomization(folder)
    used = {*listed.get("resources", []), *(p["path"] for p in listed.get("patches", []))}
    files = {p.name for p in folder.glob("*.yaml")} - {"kustomization.yaml"}
    assert files <= used, f"{folder.name}: not in kustomization.yaml: {files - used}"


@pytest.mark.parametrize(("path", "doc"), ALL, ids=[f"{p.parent.name}:{name(d)}" for p, d in ALL])
def test_resources_match_the_kubernetes_schema(path: Path, doc: Doc) -> None:
    kubernetes_validate.validate(doc, KUBERNETES, strict=True)


@pytest.mark.parametrize("folder", FOLDERS[1:], ids=lambda f: f.name)
def test_patches_target_resources_of_the_base(folder: Path) -> None:
    known = {name(doc) for _, doc in resources(ROOT / "base")}
    for patch in kustomization(folder).get("patches", []):
        for doc in load(folder / patch["path"]):
            assert name(doc) in known, f"{folder.name}/{patch['path']} patches {name(doc)}"


def test_settings_are_keys_the_server_reads() -> None:
    keys = {f"AENV_{field.upper()}" for field in Config.model_fields}
    for path, doc in ALL:
        if doc["kind"] == "ConfigMap":
            assert set(doc["data"]) <= keys, f"{path.name}: unknown settings"
        for container in containers(doc):
            for env in container.get("env", []):
                if env["name"].startswith("AENV_"):
                    assert env["name"] in keys, f"{name(doc)}: {env['name']} is not a setting"


def test_roles_are_commands_of_the_cli() -> None:
    command = typer.main.get_command(cli_app)
    commands = set(getattr(command, "commands", {}))
    for _, doc in ALL:
        for container in containers(doc):
            if container["image"] == "aenv":
                assert container["args"][0] in commands, f"{name(doc)}: aenv {container['args']}"


def test_secret_keys_exist_in_the_example_secret() -> None:
    [example] = load(ROOT / "secret.example.yaml")
    keys = set(example["stringData"])
    used: list[tuple[str, str]] = []
    for _, doc in ALL:
        for container in containers(doc):
            for env in container.get("env", []):
                if ref := env.get("valueFrom", {}).get("secretKeyRef"):
                    used.append((ref["name"], ref["key"]))
        for volume in doc.get("spec", {}).get("template", {}).get("spec", {}).get("volumes", []):
            if secret := volume.get("secret"):
                used += [(secret["secretName"], item["key"]) for item in secret["items"]]
    assert ("aenv-cluster", "api-key") in used
    for secret_name, key in used:
        assert secret_name == example["metadata"]["name"]
        assert key in keys, f"secret key {key}"


def test_only_nodes_are_privileged() -> None:
    checked = 0
    for _, doc in ALL:
        for container in containers(doc):
            context = container.get("securityContext", {})
            if doc["metadata"]["name"] == "aenv-node":
                assert context.get("privileged") is True
                continue
            pod = doc["spec"]["template"]["spec"].get("securityContext", {})
            assert pod.get("runAsNonRoot") is True, name(doc)
            assert context.get("allowPrivilegeEscalation") is False, name(doc)
            assert context.get("readOnlyRootFilesystem") is True, name(doc)
            assert context.get("capabilities", {}).get("drop") == ["ALL"], name(doc)
            assert not doc["spec"]["template"]["spec"].get("hostNetwork"), name(doc)
            checked += 1
    assert checked >= 2  # the gateway and the dev Redis


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.parametrize("folder", FOLDERS[1:], ids=lambda f: f.name)
def test_overlays_render_to_valid_resources(folder: Path) -> None:
    out = subprocess.run(
        ["kubectl", "kustomize", str(folder)], capture_output=True, text=True, check=True
    ).stdout
    rendered = [doc for doc in yaml.safe_load_all(out) if doc]
    assert {"DaemonSet/aenv-node", "Deployment/aenv-gateway"} <= {name(d) for d in rendered}
    for doc in rendered:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)
