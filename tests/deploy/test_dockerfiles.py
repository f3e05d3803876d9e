"""The Dockerfiles agree with the charts and the code, without building anything: the user the pods
run as, the ports, the module started, pip installs that cover every third-party import of the
service, the production bases as defaults, labels, and a build context of only what is copied.
(tests/deploy/test_images.py builds and runs them: make test-images.)"""

from __future__ import annotations

import importlib.metadata
import re
import tomllib

import pytest
import yaml

from tests.deploy.charts import CHARTS_DIR
from tests.deploy.service_imports import needing_triton, third_party_imports

REPO = CHARTS_DIR.parents[1]
# Dockerfile -> the chart (and service) it serves.
DOCKERFILES = {"gateway": "gateway", "router": "router", "conversations": "conversations",
               "worker": "worker", "worker-cpu": "worker"}
PRODUCTION_BASES = {"worker": "nvidia/cuda:"}                     # the rest: python:3.11-slim-bookworm


def left_out(name: str) -> set[str]:
    """Modules the image cannot import on purpose: the CPU worker's has no triton (GPU kernels)."""
    return needing_triton(DOCKERFILES[name]) if name == "worker-cpu" else set()


def dockerfile(name: str) -> str:
    return (REPO / "deploy" / "docker" / f"{name}.Dockerfile").read_text()


def stages(text: str) -> dict[str, str]:
    """Stage name -> its instructions ("" for the final, unnamed stage)."""
    found = {}
    for stage in re.split(r"^FROM ", text, flags=re.M)[1:]:
        header = stage.splitlines()[0].split()
        found[header[2] if len(header) == 3 and header[1].upper() == "AS" else ""] = stage
    return found


@pytest.mark.parametrize("name", DOCKERFILES)
def test_image_matches_the_chart(name):
    service = DOCKERFILES[name]
    text = dockerfile(name)
    values = yaml.safe_load((CHARTS_DIR / service / "values.yaml").read_text())
    security = values["podSecurityContext"]
    assert security["runAsUser"] != 0
    assert f"USER {security['runAsUser']}:{security['runAsGroup']}" in stages(text)[""]
    assert f'ENTRYPOINT ["python", "-m", "services.{service}"]' in text
    assert f'CMD ["--config", "/etc/llmserve/{service}.yaml"]' in text
    exposed = {int(p) for line in re.findall(r"^EXPOSE (.+)$", text, re.M) for p in line.split()}
    server = values["config"]["server"]
    assert {server["port"], server.get("metrics_port", server["port"])} <= exposed
    assert not re.search(r"^FROM \S+:latest\b", text, re.M)


@pytest.mark.parametrize("name", DOCKERFILES)
def test_production_base_labels_and_layers(name):
    text = dockerfile(name)
    # A `# syntax=` line makes BuildKit fetch its frontend from a registry.
    assert not re.search(r"^#\s*syntax=", text, re.M)
    [base_arg] = re.findall(r"^ARG (PYTHON_IMAGE|CUDA_IMAGE)=(\S+)$", text, re.M)
    assert base_arg[1].startswith(PRODUCTION_BASES.get(name, "python:3.11-slim-bookworm"))
    # A plain `docker build` labels the image with the project's version.
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert f"ARG VERSION={version}" in text
    for label in ("version", "source", "revision", "title"):
        assert f"org.opencontainers.image.{label}=" in text
    final = stages(text)[""]
    # The runtime stage installs nothing: it copies the venv stage's packages and stubs.
    assert "pip install" not in final and "COPY --from=venv /opt/venv /opt/venv" in final
    # Code changes most often, so it is copied last: a code change rebuilds no package layer.
    copies = re.findall(r"^COPY (?:--from=\S+ )?(\S+)", final, re.M)
    assert copies[0] == "/opt/venv" and copies[-1] == f"services/{DOCKERFILES[name]}"


def test_the_build_context_holds_only_what_the_dockerfiles_copy():
    rules = [line for line in (REPO / ".dockerignore").read_text().splitlines() if line and not line.startswith("#")]
    assert rules[0] == "*", ".dockerignore starts by leaving everything out"
    allowed = {rule[1:].rstrip("/") for rule in rules if rule.startswith("!")}
    copied = {source.rstrip("/") for name in DOCKERFILES for source in
              re.findall(r"^COPY (?!--from)(\S+) ", dockerfile(name), re.M)}
    # Each copied path is let in (itself or a folder above it), and nothing else is.
    assert all(any(c == a or c.startswith(a + "/") for a in allowed) for c in copied), (copied, allowed)
    assert all(any(c == a or c.startswith(a + "/") for c in copied) for a in allowed), (copied, allowed)
    assert "libs/llmserve/v1/" in rules   # the images generate their own stubs from protos/


@pytest.mark.parametrize("name", DOCKERFILES)
def test_image_installs_every_third_party_import(name):
    installed = pip_installed(dockerfile(name))
    providers = importlib.metadata.packages_distributions()   # module -> distributions (namespaces: several)
    missing = sorted(module for module in third_party_imports(DOCKERFILES[name], left_out(name))
                     if not {normalize(d) for d in providers.get(module, [module])} & installed)
    assert missing == [], f"{name}.Dockerfile installs nothing that provides {missing}"


def test_the_cpu_worker_image_leaves_out_only_the_triton_kernels():
    cpu = pip_installed(dockerfile("worker-cpu"))
    assert "triton" not in cpu and "triton" in pip_installed(dockerfile("worker"))
    assert third_party_imports("worker", left_out("worker-cpu")) == third_party_imports("worker") - {"triton"}


def pip_installed(text: str) -> set[str]:
    """Distribution names given to `pip install` in the venv stage, versions and options dropped."""
    venv = stages(text)["venv"].replace("\\\n", " ")
    names = set()
    for command in re.findall(r"pip install ([^\n&]+)", venv):
        words = iter(command.split())
        for word in words:
            if word in ("-c", "-r", "--constraint"):
                next(words)
            elif not word.startswith("-"):
                names.add(normalize(re.split(r"[=<>!~\[]", word)[0]))
    return names - {"grpcio-tools"}   # the stub generator's, in its own venv (/opt/protoc)


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()
