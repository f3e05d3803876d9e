"""A chart's pod as `docker run` arguments: what the kubelet would give the container, from the
rendered Deployment, ConfigMap and Secret, on the host's network.

Translated: command (the image's entrypoint is overridden, as a pod's `command` does), env (values
and secretKeyRefs into the rendered Secret), runAsUser/runAsGroup/fsGroup, readOnlyRootFilesystem,
dropped capabilities, allowPrivilegeEscalation, the memory limit, and the volumes: a configMap as
read-only files, an emptyDir as a tmpfs of its size limit, a hostPath as a bind mount. Anything
else (a persistentVolumeClaim, a secret volume, ...) is refused, so nothing is silently left out.
The probes are kept for the caller to run.
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass, field
from pathlib import Path

from tests.deploy.charts import Rendered

UNITS = {"": 1, "k": 1000, "M": 1000**2, "G": 1000**3, "Ki": 1024, "Mi": 1024**2, "Gi": 1024**3, "Ti": 1024**4}


@dataclass
class Pod:
    name: str                          # the container's name in Docker
    image: str
    run_args: list[str]                # `docker run` options, then the image, then the arguments
    ports: dict[str, int]              # container port name -> number
    probes: dict[str, dict]            # startup / readiness / liveness, as the chart gives them
    grace_s: int                       # terminationGracePeriodSeconds
    security: dict = field(default_factory=dict)   # the pod and container securityContext, merged


def quantity_bytes(quantity: str) -> int:
    number, unit = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(quantity)).groups()
    return int(float(number) * UNITS[unit])


def pod(rendered: Rendered, name: str, files_dir: Path) -> Pod:
    [deployment] = rendered.of_kind("Deployment")
    spec = deployment["spec"]["template"]["spec"]
    [container] = spec["containers"]
    security = {**spec.get("securityContext", {}), **container.get("securityContext", {})}
    args = ["--name", name, "--network", "host", *_security(security)]
    if limit := container.get("resources", {}).get("limits", {}).get("memory"):
        args += ["--memory", str(quantity_bytes(limit))]
    args += [a for key, value in _env(container, rendered).items() for a in ("--env", f"{key}={value}")]
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        args += ["--mount", _mount(mount, volumes[mount["name"]], rendered, files_dir)]
    command = container["command"]
    args += ["--entrypoint", command[0], container["image"], *command[1:], *container.get("args", [])]
    ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    probes = {kind: container[f"{kind}Probe"] for kind in ("startup", "readiness", "liveness")
              if f"{kind}Probe" in container}
    return Pod(name, container["image"], args, ports, probes, spec.get("terminationGracePeriodSeconds", 30),
               security)


def _security(context: dict) -> list[str]:
    args = []
    if "runAsUser" in context:
        args += ["--user", f"{context['runAsUser']}:{context.get('runAsGroup', context['runAsUser'])}"]
    if "fsGroup" in context:
        args += ["--group-add", str(context["fsGroup"])]
    if context.get("readOnlyRootFilesystem"):
        args.append("--read-only")
    args += [a for cap in context.get("capabilities", {}).get("drop", []) for a in ("--cap-drop", cap)]
    if context.get("allowPrivilegeEscalation") is False:
        args += ["--security-opt", "no-new-privileges"]
    return args


def _env(container: dict, rendered: Rendered) -> dict[str, str]:
    env = {}
    for entry in container.get("env", []):
        if "value" in entry:
            env[entry["name"]] = str(entry["value"])
            continue
        ref = entry["valueFrom"]["secretKeyRef"]
        data = _secret_data(rendered, ref["name"])
        if ref["key"] in data:
            env[entry["name"]] = data[ref["key"]]
        elif not ref.get("optional"):
            raise ValueError(f"{entry['name']}: Secret {ref['name']} has no key {ref['key']}")
    return env


def _secret_data(rendered: Rendered, name: str) -> dict[str, str]:
    found = [s for s in rendered.of_kind("Secret") if s["metadata"]["name"] == name]
    return {k: base64.b64decode(v).decode() for s in found for k, v in s.get("data", {}).items()}


def _mount(mount: dict, volume: dict, rendered: Rendered, files_dir: Path) -> str:
    target, read_only = mount["mountPath"], mount.get("readOnly", False)
    if "configMap" in volume:
        config_map = rendered.one("ConfigMap", volume["configMap"]["name"])
        folder = files_dir / volume["name"]
        folder.mkdir(parents=True, exist_ok=True)
        folder.chmod(0o755)
        for key, text in config_map["data"].items():
            (folder / key).write_text(text)
            (folder / key).chmod(0o644)
        source = folder / mount["subPath"] if "subPath" in mount else folder
        return f"type=bind,source={source},target={target},readonly"
    if "emptyDir" in volume:
        size = volume["emptyDir"].get("sizeLimit")
        return f"type=tmpfs,target={target}" + (f",tmpfs-size={quantity_bytes(size)}" if size else "")
    if "hostPath" in volume:
        return f"type=bind,source={volume['hostPath']['path']},target={target}" + (",readonly" if read_only else "")
    raise ValueError(f"volume {volume['name']}: only configMap, emptyDir and hostPath run under Docker here")
