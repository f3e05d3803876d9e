"""The Dockerfiles agree with the charts and the code: the user the pods run as, the ports, the
module started, and pip installs that cover every third-party import of the service."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys

import pytest
import yaml

from tests.deploy.charts import CHARTS_DIR, SERVICE_CHARTS

REPO = CHARTS_DIR.parents[1]


def dockerfile(service: str) -> str:
    return (REPO / "deploy" / "docker" / f"{service}.Dockerfile").read_text()


@pytest.mark.parametrize("service", SERVICE_CHARTS)
def test_image_matches_the_chart(service):
    text = dockerfile(service)
    values = yaml.safe_load((CHARTS_DIR / service / "values.yaml").read_text())
    assert f"USER {values['podSecurityContext']['runAsUser']}:" in text
    assert f'ENTRYPOINT ["python", "-m", "services.{service}"]' in text
    exposed = {int(p) for line in re.findall(r"^EXPOSE (.+)$", text, re.M) for p in line.split()}
    server = values["config"]["server"]
    assert {server["port"], server.get("metrics_port", server["port"])} <= exposed
    assert not re.search(r"^FROM \S+:latest\b", text, re.M)


@pytest.mark.parametrize("service", SERVICE_CHARTS)
def test_image_installs_every_third_party_import(service):
    installed = pip_installed(dockerfile(service))
    providers = importlib.metadata.packages_distributions()   # module -> distributions (namespaces: several)
    missing = sorted(module for module in third_party_imports(service)
                     if not {normalize(d) for d in providers.get(module, [module])} & installed)
    assert missing == [], f"{service}.Dockerfile installs nothing that provides {missing}"


def pip_installed(text: str) -> set[str]:
    """Distribution names given to `pip install` in the final stage, versions and options dropped."""
    final_stage = re.split(r"^FROM ", text, flags=re.M)[-1].replace("\\\n", " ")
    names = set()
    for command in re.findall(r"pip install ([^\n&]+)", final_stage):
        words = iter(command.split())
        for word in words:
            if word in ("-c", "-r", "--constraint"):
                next(words)
            elif not word.startswith("-"):
                names.add(normalize(re.split(r"[=<>!~\[]", word)[0]))
    return names


def third_party_imports(service: str) -> set[str]:
    """Top-level modules imported by the service's code and by the libs/llmserve modules it reaches."""
    libs = REPO / "libs"
    queue = list((REPO / "services" / service).rglob("*.py"))
    seen, modules = set(queue), set()
    while queue:
        imported = _imports(queue.pop())
        modules |= {name.split(".")[0] for name in imported}
        for name in imported:
            if name.startswith("llmserve.") and not name.startswith("llmserve.v1"):  # v1: generated stubs
                path = libs / (name.replace(".", "/") + ".py")
                if path.exists() and path not in seen:
                    seen.add(path)
                    queue.append(path)
    ours = {"services", "llmserve", "__future__"}
    return {m for m in modules - ours if m not in sys.stdlib_module_names}


def _imports(path) -> set[str]:
    """Absolute module names a file imports (`from a import b` counts as a and a.b: b may be a module)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()
