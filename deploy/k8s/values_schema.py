"""Writes each service chart's values.schema.json from the one description below.

    python deploy/k8s/values_schema.py          # after changing a chart's values.yaml keys

Helm checks values against the schema on install, upgrade, template and lint, so a misspelt key
(`autoscalling`, `minReplica`) is an error instead of a silently ignored setting. `config` stays
open: the service's own typed config rejects unknown fields when it starts (and tests/deploy loads
every rendered config with it). Kubernetes objects passed through as they are (resources,
affinity, security contexts ...) are checked by Kubernetes. tests/deploy checks the files are
what this script writes.
"""

from __future__ import annotations

import json
from pathlib import Path

CHARTS_DIR = Path(__file__).resolve().parent

STRING = {"type": "string"}
BOOLEAN = {"type": "boolean"}
OBJECT = {"type": "object"}
ARRAY = {"type": "array"}
COUNT = {"type": "integer", "minimum": 0}
QUANTITY = {"type": ["string", "integer"]}          # 1Gi, "500m", 3
INT_OR_PERCENT = {"type": ["integer", "string"]}     # 1, "25%"; "" leaves it unset


def closed(properties: dict, **extra) -> dict:
    return {"type": "object", "additionalProperties": False, "properties": properties, **extra}


def string_map() -> dict:
    return {"type": "object", "additionalProperties": {"type": "string"}}


PROBE = closed({key: COUNT for key in ("initialDelaySeconds", "periodSeconds", "timeoutSeconds",
                                       "successThreshold", "failureThreshold")})

COMMON = {
    "global": OBJECT,                                 # Helm's, shared with an umbrella chart
    "enabled": BOOLEAN,                               # the umbrella chart's condition
    "common": OBJECT,                                 # Helm's entry for the library chart
    "image": closed({"repository": STRING, "tag": STRING,
                     "pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]}}),
    "imagePullSecrets": ARRAY,
    "nameOverride": STRING,
    "fullnameOverride": STRING,
    "replicaCount": COUNT,
    "config": OBJECT,
    "env": ARRAY,
    "secrets": closed({"existingSecret": STRING, "values": string_map(), "env": string_map()}),
    "resources": OBJECT,
    "nodeSelector": OBJECT,
    "tolerations": ARRAY,
    "affinity": OBJECT,
    "topologySpreadConstraints": ARRAY,
    "priorityClassName": STRING,
    "podAnnotations": OBJECT,
    "podLabels": OBJECT,
    "strategy": OBJECT,
    "terminationGracePeriodSeconds": COUNT,
    "preStopSleepSeconds": COUNT,
    "probes": closed({"startup": PROBE, "readiness": PROBE, "liveness": PROBE}),
    "tmpSizeLimit": QUANTITY,
    "podSecurityContext": OBJECT,
    "securityContext": OBJECT,
    "serviceAccount": closed({"create": BOOLEAN, "name": STRING, "annotations": OBJECT}),
    "service": closed({"type": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]},
                       "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                       "annotations": OBJECT}),
    "podDisruptionBudget": closed({"enabled": BOOLEAN, "maxUnavailable": INT_OR_PERCENT,
                                   "minAvailable": INT_OR_PERCENT}),
    "serviceMonitor": closed({"enabled": BOOLEAN, "interval": STRING, "scrapeTimeout": STRING,
                              "labels": OBJECT, "tlsConfig": OBJECT}),
}

AUTOSCALING = {"enabled": BOOLEAN, "minReplicas": {"type": "integer", "minimum": 1},
               "maxReplicas": {"type": "integer", "minimum": 1}, "behavior": OBJECT}
CPU_AUTOSCALING = closed({**AUTOSCALING, "targetCPUUtilizationPercentage":
                          {"type": "integer", "minimum": 1, "maximum": 100}})

CHARTS = {
    "gateway": {
        "autoscaling": CPU_AUTOSCALING,
        "tls": closed({"enabled": BOOLEAN, "secretName": STRING, "mountPath": STRING}),
    },
    "router": {"autoscaling": CPU_AUTOSCALING},
    "conversations": {"autoscaling": CPU_AUTOSCALING},
    "worker": {
        "autoscaling": closed({**AUTOSCALING, "queueDepth": closed(
            {"metricName": STRING, "targetAverageValue": QUANTITY})}),
        "model": closed({"mountPath": STRING,
                         "from": {"enum": ["persistentVolumeClaim", "hostPath", "volume"]},
                         "persistentVolumeClaim": OBJECT, "hostPath": OBJECT, "volume": OBJECT}),
        "shm": closed({"sizeLimit": QUANTITY}),
    },
}


def schema(chart: str) -> dict:
    return {"$schema": "https://json-schema.org/draft-07/schema#",
            "title": f"llmserve {chart} chart values",
            **closed({**COMMON, **CHARTS[chart]})}


def schema_text(chart: str) -> str:
    return json.dumps(schema(chart), indent=2) + "\n"


def main() -> None:
    for chart in CHARTS:
        (CHARTS_DIR / chart / "values.schema.json").write_text(schema_text(chart))


if __name__ == "__main__":
    main()
