#!/usr/bin/env python3
"""Generate helm/nvmeof-gateway/values.schema.json (JSON Schema draft-07, as Helm v4 checks it).

usage: helm/gen-values-schema.py [--check]

The schema is written here in Python (short and reviewable) and rendered to JSON. Every
object refuses unknown keys (additionalProperties: false), except the Kubernetes objects
passed through as they are (affinity, tolerations, security contexts, EnvVars,
NetworkPolicyPeers, Prometheus rules, extraObjects), which kubernetes-validate checks in the
rendered manifests (tests/helm). --check: exit 1 if values.schema.json differs from what this
generates. Standard library only.
"""
import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "nvmeof-gateway" / "values.schema.json"


def obj(props, required=None, desc=None):
    """An object that refuses keys it does not list."""
    o = {"type": "object", "additionalProperties": False, "properties": props}
    if required:
        o["required"] = required
    if desc:
        o["description"] = desc
    return o


def string(**k):
    return {"type": "string", **k}


def integer(**k):
    return {"type": "integer", **k}


def nullable_int(**k):
    return {"type": ["integer", "null"], **k}


def free_obj(description):
    """A Kubernetes object passed through (kubernetes-validate checks the rendered result)."""
    return {"type": "object", "description": description}


def k8s_list(description):
    return {"type": "array", "items": {"type": "object"}, "description": description}


BOOLEAN = {"type": "boolean"}
str_map = {"type": "object", "additionalProperties": {"type": "string"}}
port = integer(minimum=1, maximum=65535)
quantity = {"type": ["string", "integer", "number"]}
resources = obj({
    "requests": {"type": "object", "additionalProperties": quantity},
    "limits": {"type": "object", "additionalProperties": quantity},
    "claims": {"type": "array", "items": {"type": "object"}},
}, desc="Container resources (requests/limits).")
duration = string(pattern=r"^([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$")


def probe():
    return obj({"periodSeconds": integer(minimum=1), "failureThreshold": integer(minimum=1),
                "timeoutSeconds": integer(minimum=1)},
               required=["periodSeconds", "failureThreshold", "timeoutSeconds"])


# maxUnavailable: a count (at least 1) or a percentage
pdb = obj({"enabled": BOOLEAN,
           "maxUnavailable": {"type": ["integer", "string"], "minimum": 1, "pattern": r"^[0-9]+%$"}},
          required=["enabled", "maxUnavailable"])
sched = {
    "nodeSelector": str_map,
    "tolerations": k8s_list("Tolerations."),
    "affinity": free_obj("Affinity."),
    "topologySpreadConstraints": k8s_list("Topology spread constraints."),
    "priorityClassName": string(),
    "podAnnotations": str_map,
    "podLabels": str_map,
    "podSecurityContext": free_obj("PodSecurityContext."),
    "securityContext": free_obj("SecurityContext."),
    "resources": resources,
    "extraEnv": k8s_list("EnvVar list."),
    "logLevel": string(minLength=1),
}
control = obj({
    "replicas": integer(minimum=1),
    "port": port,
    "metricsPort": port,
    "graceMs": nullable_int(minimum=1),
    "failbackDelayMs": nullable_int(minimum=0),
    "leaseMs": nullable_int(minimum=1),
    "extraArgs": {"type": "array", "items": {"type": "string"}},
    **sched,
    "probes": obj({"readiness": probe(), "liveness": probe()}, required=["readiness", "liveness"]),
    "podDisruptionBudget": pdb,
    "service": obj({"annotations": str_map}),
})
listener = obj({
    "transport": string(enum=["tcp", "rdma"]),
    "address": string(minLength=1),
    "port": port,
}, required=["transport", "address"])
gateway = obj({
    "replicas": integer(minimum=1, maximum=32),
    "hostNetwork": BOOLEAN,
    "privileged": BOOLEAN,
    "terminationGracePeriodSeconds": integer(minimum=15),
    "updatePartition": integer(minimum=0),
    "ports": obj({"metrics": port, "nvme": port}, required=["metrics", "nvme"]),
    "workerThreads": nullable_int(minimum=1),
    "beaconIntervalMs": nullable_int(minimum=1, maximum=1000),
    "leaveTimeoutMs": integer(minimum=1, maximum=600000),
    "stallWindowMs": nullable_int(minimum=400, maximum=600000),
    "tcpDataBudget": string(pattern=r"^$|^[0-9]+ ?([KMGT]i?[Bb]?|[kmgt]i?b?|[Bb])?$"),
    "cephConnections": nullable_int(minimum=1, maximum=64),
    "cephOptions": {"type": "object", "propertyNames": {"pattern": "^[A-Za-z0-9_]+$"},
                    "additionalProperties": {"type": ["string", "integer", "number", "boolean"]}},
    "listeners": {"type": "array", "items": listener},
    "rdma": obj({"enabled": BOOLEAN, "resourceName": string(pattern=r"^[A-Za-z0-9.-]+/[A-Za-z0-9._-]+$"), "resourceCount": integer(minimum=1)},
                required=["enabled", "resourceName", "resourceCount"]),
    **sched,
    "probes": obj({"startup": probe(), "readiness": probe(), "liveness": probe()}, required=["startup", "readiness", "liveness"]),
    "podDisruptionBudget": pdb,
})
monitor = lambda: obj({"enabled": BOOLEAN, "interval": duration, "scrapeTimeout": duration, "labels": str_map})
schema = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "title": "nvmeof-gateway chart values",
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "global": {"type": "object", "description": "Helm's global values (parent charts)."},
        "nameOverride": string(maxLength=63),
        "fullnameOverride": string(maxLength=63),
        "commonLabels": str_map,
        "image": obj({"repository": string(minLength=1), "tag": string(), "pullPolicy": string(enum=["Always", "IfNotPresent", "Never"])},
                     required=["repository", "pullPolicy"]),
        "imagePullSecrets": {"type": "array", "items": obj({"name": string(minLength=1)}, required=["name"])},
        "group": obj({"name": string(pattern=r"^[A-Za-z0-9_.-]+$"), "statePool": string(minLength=1, pattern=r"^[^/@\s]+$")},
                     required=["name", "statePool"]),
        "ceph": obj({
            "clientName": string(pattern=r"^client\.[^\s]+$"),
            "monHost": string(),
            "monHostSecret": obj({"name": string(), "key": string(minLength=1, pattern=r"^[-._a-zA-Z0-9]+$")}),
            "config": string(),
            "existingConfigMap": string(),
            "existingConfigMapKey": string(minLength=1),
            "keyringSecret": obj({"name": string(), "key": string(minLength=1, pattern=r"^[-._a-zA-Z0-9]+$"), "cephxKey": string()}),
        }, required=["clientName"]),
        "serviceAccount": obj({"create": BOOLEAN, "name": string(), "annotations": str_map, "automountServiceAccountToken": BOOLEAN}),
        "clusterDomain": string(minLength=1),
        "controlPlane": control,
        "gateway": gateway,
        "tls": obj({
            "enabled": BOOLEAN,
            "controlSecret": string(), "gatewaySecret": string(), "cliSecret": string(),
            "certManager": obj({
                "enabled": BOOLEAN,
                "issuerRef": obj({"name": string(), "kind": string(enum=["Issuer", "ClusterIssuer"]), "group": string(minLength=1)}),
                "duration": duration, "renewBefore": duration, "caDuration": duration,
            }),
        }),
        "monitoring": obj({
            "serviceMonitor": monitor(),
            "podMonitor": monitor(),
            "prometheusRule": obj({
                "enabled": BOOLEAN, "labels": str_map,
                "beaconAgeSeconds": {"type": "number", "exclusiveMinimum": 0},
                "readLatencySeconds": {"type": "number", "exclusiveMinimum": 0},
                "writeLatencySeconds": {"type": "number", "exclusiveMinimum": 0},
                "additionalRules": k8s_list("Prometheus rules."),
            }),
        }),
        "networkPolicy": obj({
            "enabled": BOOLEAN,
            "nodeCIDRs": {"type": "array", "items": string(pattern=r"^[0-9a-fA-F.:]+/[0-9]+$")},
            "grpcFrom": k8s_list("NetworkPolicyPeer list."),
            "metricsFrom": k8s_list("NetworkPolicyPeer list."),
            "nvmeFrom": k8s_list("NetworkPolicyPeer list."),
        }),
        "tests": obj({"enabled": BOOLEAN, "resources": resources}),
        "extraObjects": {"type": "array", "items": {"type": ["object", "string"]}},
    },
}


def main(argv):
    text = json.dumps(schema, indent=2, ensure_ascii=False) + "\n"
    if "--check" in argv:
        if OUT.read_text() != text:
            print(f"gen-values-schema: {OUT} is stale: run helm/gen-values-schema.py", file=sys.stderr)
            return 1
        return 0
    if not OUT.exists() or OUT.read_text() != text:
        OUT.write_text(text)
        print(f"gen-values-schema: {OUT} updated")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
