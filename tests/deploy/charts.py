"""Offline Helm for the tests: build chart dependencies in a scratch copy, render, lint, validate.

No helm binary and no cluster: helm-python-sdk embeds Helm 4's library, kubernetes-validate holds
the Kubernetes API schemas.
"""

from __future__ import annotations

import functools
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import helm_python as helm
import kubernetes_validate
import yaml
from kubernetes_validate.utils import SchemaNotFoundError, latest_version

CHARTS_DIR = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
SERVICE_CHARTS = ("gateway", "router", "worker", "conversations")
UMBRELLA = "llmserve"
# The oldest Kubernetes the charts claim (Chart.yaml kubeVersion) and the newest schemas we have.
KUBE_VERSIONS = ("1.30", latest_version())
# Custom resources without a schema in kubernetes-validate; their content is asserted instead.
CUSTOM_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}


def build_charts(workdir: Path) -> Path:
    """A copy of deploy/k8s with every chart's dependencies packaged into its charts/ folder,
    subcharts before the umbrella (which packages them, their own charts/ included)."""
    root = workdir / "k8s"
    shutil.copytree(CHARTS_DIR, root, ignore=shutil.ignore_patterns("charts", "Chart.lock"))
    for name in (*SERVICE_CHARTS, UMBRELLA):
        helm.dependency_build(str(root / name))
    return root


@dataclass
class Rendered:
    manifests: list[dict]        # every Kubernetes object, in template order
    notes: str                   # the chart's own NOTES.txt (subcharts' are not shown by Helm)

    def of_kind(self, kind: str) -> list[dict]:
        return [m for m in self.manifests if m["kind"] == kind]

    def one(self, kind: str, name: str) -> dict:
        found = [m for m in self.of_kind(kind) if m["metadata"]["name"] == name]
        assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
        return found[0]


def render(chart_dir: Path, values: dict, release: str = "llmserve", namespace: str = "llm") -> Rendered:
    with helm.Chart.load(str(chart_dir)) as chart:
        files = chart.render(values, name=release, namespace=namespace, is_install=True)
    notes = files.get(f"{chart_dir.name}/templates/NOTES.txt", "")
    manifests = [doc for path, text in files.items() if not path.endswith("NOTES.txt")
                 for doc in yaml.safe_load_all(text) if doc]
    return Rendered(manifests, notes)


def lint_findings(chart_dir: Path, values: dict) -> list[str]:
    """Strict lint: errors and warnings (severity >= 2); info such as 'icon is recommended' passes."""
    report = helm.lint(str(chart_dir), values, strict=True, namespace="llm",
                       kube_version=f"v{KUBE_VERSIONS[0]}.0")
    return report["errors"] + [f"{m['path']}: {m['error']}" for m in report["messages"]
                               if m["severity"] >= 2]


def schema_errors(manifest: dict) -> list[str]:
    """Strict validation (unknown fields are errors) against every version in KUBE_VERSIONS."""
    return _schema_errors(json.dumps(manifest, sort_keys=True))


@functools.lru_cache(maxsize=None)
def _schema_errors(manifest_json: str) -> list[str]:
    """Cached: the umbrella renders the same objects as the service charts."""
    manifest = json.loads(manifest_json)
    where = f"{manifest['kind']}/{manifest['metadata']['name']}"
    errors = []
    for version in KUBE_VERSIONS:
        try:
            kubernetes_validate.validate(manifest, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            errors.append(f"{where} against {version}: {path}: {e.message}")
        except SchemaNotFoundError as e:
            if (manifest["apiVersion"], manifest["kind"]) not in CUSTOM_KINDS:
                errors.append(f"{where}: {e.message}")
    return errors
