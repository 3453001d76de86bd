"""deploy/kubernetes: every overlay renders with kustomize and validates, and its settings agree.

Rendering is `kubectl kustomize` (kustomize v5, kubectl 1.27 or later) or a standalone
`kustomize`. Kubernetes' own kinds are validated against the API schemas of the versions
docs/deploy-kubernetes.md claims (the `kubernetes-validate` package, strict: unknown fields fail), the
custom kinds against the schemas of their CRDs vendored in deploy/kubernetes/schemas/
(scripts/vendor-crd-schemas.py; versions in SOURCES.md there).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
KUBE = ROOT / "deploy" / "kubernetes"
OVERLAYS = sorted(p.name for p in (KUBE / "overlays").iterdir() if p.is_dir())
#: The Kubernetes versions docs/deploy-kubernetes.md claims: the oldest and the newest validated.
K8S_VERSIONS = ("1.29.0", "1.35.0")
#: Custom kinds: validated against deploy/kubernetes/schemas/GROUP/KIND_VERSION.json.
CUSTOM_GROUPS = ("keda.sh", "gateway.networking.k8s.io", "gateway.envoyproxy.io", "monitoring.coreos.com")
#: What the preStop sleep and the margin take out of the grace before the server's own drain.
RESERVE_S = 15


def kustomize_command() -> list[str] | None:
    if shutil.which("kubectl"):
        out = subprocess.run(["kubectl", "version", "--client", "-o", "json"], capture_output=True, text=True)
        if out.returncode == 0 and json.loads(out.stdout).get("kustomizeVersion", "").startswith("v5"):
            return ["kubectl", "kustomize"]
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    return None


def require_tool(found: object, what: str) -> None:
    """Skip without the tool, except under CI, where a missing install must fail."""
    if not found:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{what} is required under CI")
        pytest.skip(f"{what} not installed")


def render(overlay: Path) -> list[dict[str, Any]]:
    """The objects `kubectl apply -k overlay` would send."""
    command = kustomize_command()
    require_tool(command, "kustomize v5 (kubectl 1.27+ or kustomize)")
    out = subprocess.run([*command, str(overlay)], capture_output=True, text=True, check=True)
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def one(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    assert len(found) == 1, f"{len(found)} objects of kind {kind}"
    return found[0]


def container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return one(objects, "StatefulSet")["spec"]["template"]["spec"]["containers"][0]


#: The Secrets the pods read, as a test cluster would hold them (docs/deploy-kubernetes.md makes them).
SECRETS = {"duplexserve-api-keys": {"api-keys": "# the fleet's keys\nk8s-test-key\n"},
           "duplexserve-peer-secret": {"peer-secret": "k8s-test-peer-secret"}}
#: What the kubelet sets from the pod's own fields (the downward API) in the tests' pod.
FIELDS = {"metadata.name": "duplexserve-0", "metadata.namespace": "duplexserve-test"}


def secret_files(pod: dict[str, Any]) -> dict[str, str]:
    """The files the kubelet mounts from Secrets into the pod's first container: path -> text."""
    secrets = {v["name"]: v["secret"] for v in pod["volumes"] if "secret" in v}
    files = {}
    for mount in pod["containers"][0]["volumeMounts"]:
        secret = secrets.get(mount["name"])
        if secret is not None:
            assert "subPath" not in mount, "a subPath mount of a Secret is never updated"
            for key, text in SECRETS[secret["secretName"]].items():
                files[f"{mount['mountPath']}/{key}"] = text
    return files


def container_env(c: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet sets it, Secrets read from :data:`SECRETS`."""
    out = {}
    for e in c["env"]:
        ref = e.get("valueFrom", {}).get("secretKeyRef")
        field = e.get("valueFrom", {}).get("fieldRef")
        if field is not None:
            out[e["name"]] = FIELDS[field["fieldPath"]]
        else:
            out[e["name"]] = SECRETS[ref["name"]][ref["key"]] if ref else e["value"]
    return out


def env(objects: list[dict[str, Any]]) -> dict[str, str]:
    return container_env(container(objects))


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(KUBE / "overlays" / request.param)


def crd_schema(obj: dict[str, Any]) -> dict[str, Any]:
    group, version = obj["apiVersion"].split("/")
    path = KUBE / "schemas" / group / f"{obj['kind']}_{version}.json"
    assert path.exists(), f"no vendored schema for {obj['apiVersion']} {obj['kind']}"
    return json.loads(path.read_text())


def strict(node: Any) -> Any:
    """The schema as ``kubectl apply`` checks it (strict field validation, its default): a field
    the CRD does not name is an error, unless the CRD keeps unknown fields there."""
    if isinstance(node, list):
        return [strict(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: strict(v) for k, v in node.items()}
    if "properties" in out and "additionalProperties" not in out \
            and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def validate_custom(obj: dict[str, Any]) -> None:
    """Against the CRD's schema, strict: not checked against the metaschema, since some of its
    patterns are Go's (RE2 flags Python's re refuses) in fields this project never sets."""
    jsonschema.Draft7Validator(strict(crd_schema(obj))).validate(obj)


def test_every_object_validates(rendered) -> None:
    _, objects = rendered
    kinds = {o["kind"] for o in objects}
    assert kinds == {"Namespace", "StatefulSet", "Service", "PodDisruptionBudget", "HTTPRoute",
                     "BackendTrafficPolicy", "ScaledObject", "ServiceMonitor", "PrometheusRule",
                     "NetworkPolicy"}
    validate_all(objects)


def test_the_shared_gateway_validates() -> None:
    objects = render(KUBE / "gateway")
    kinds = {o["kind"] for o in objects}
    assert kinds == {"Namespace", "Gateway", "HTTPRoute", "ClientTrafficPolicy", "ConfigMap", "EnvoyProxy",
                     "PriorityClass"}
    validate_all(objects)


def validate_all(objects: list[dict[str, Any]]) -> None:
    for obj in objects:
        if obj["apiVersion"].split("/")[0] in CUSTOM_GROUPS:
            validate_custom(obj)
        else:
            for version in K8S_VERSIONS:
                kubernetes_validate.validate(obj, version, strict=True)


def test_schemas_catch_a_misspelt_field(rendered) -> None:
    """The validation has teeth for both families: an unknown field fails."""
    _, objects = rendered
    route = json.loads(json.dumps(one(objects, "BackendTrafficPolicy")))
    route["spec"]["loadBalancer"]["type"] = "LeastConnections"
    with pytest.raises(jsonschema.ValidationError):
        validate_custom(route)
    deployment = json.loads(json.dumps(one(objects, "StatefulSet")))
    deployment["spec"]["template"]["spec"]["terminationGracePeriod"] = 60
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[0], strict=True)


def test_routes_need_only_the_standard_channel(rendered) -> None:
    """The vendored HTTPRoute schema is Gateway API's standard channel: the experimental channel's
    session persistence (once the resume's affinity) is refused, and no route uses it."""
    _, objects = rendered
    route = json.loads(json.dumps(one(objects, "HTTPRoute")))
    validate_custom(route)
    route["spec"]["rules"][0]["sessionPersistence"] = {"sessionName": "duplexserve-replica", "type": "Cookie"}
    with pytest.raises(jsonschema.ValidationError):
        validate_custom(route)


def test_pod_is_one_gpu_locked_down_and_probed(rendered) -> None:
    _, objects = rendered
    pod = one(objects, "StatefulSet")["spec"]["template"]["spec"]
    c = container(objects)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 10001
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    startup = c["startupProbe"]
    # a 10-20 s start plus a checkpoint read from a slow volume (PersonaPlex: 16 GB)
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 240
    e = env(objects)
    assert e["HF_HUB_OFFLINE"] == "1" and e["DUPLEXSERVE_REFUSE_WITH_HTTP_503"] == "true"
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert mounts["/huggingface"]["readOnly"] is True
    for var in ("TMPDIR", "HOME", "TRITON_CACHE_DIR"):
        assert any(e[var].startswith(path) for path in mounts), f"{var} is not on a writable volume"


def test_drain_grace_follows_the_pod_grace(rendered) -> None:
    """One setting: the server drains for terminationGracePeriodSeconds - 15 s (the preStop
    sleep and a margin), and the drain-past-grace alert waits the grace."""
    _, objects = rendered
    pod = one(objects, "StatefulSet")["spec"]["template"]["spec"]
    grace = pod["terminationGracePeriodSeconds"]
    assert env(objects)["DUPLEXSERVE_TERMINATION_GRACE_S"] == str(grace)
    c = container(objects)
    assert f"$((DUPLEXSERVE_TERMINATION_GRACE_S - {RESERVE_S}))" in c["args"][0]
    pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep" and int(pre_stop[1]) < RESERVE_S
    rules = one(objects, "PrometheusRule")["spec"]["groups"][0]["rules"]
    assert next(r for r in rules if r.get("alert") == "DuplexserveDrainPastGrace")["for"] == f"{grace}s"


def test_a_grace_set_in_an_overlay_carries_to_the_server_and_the_alert(tmp_path) -> None:
    """The overlay's model patch sets terminationGracePeriodSeconds: both followers follow."""
    copy = tmp_path / "kubernetes"
    shutil.copytree(KUBE, copy)
    patch = copy / "overlays" / "hibiki-zero-3b" / "model" / "model.yaml"
    grace = "    spec:\n      terminationGracePeriodSeconds: 1800\n"
    patch.write_text(patch.read_text().replace("    spec:\n", grace, 1))
    objects = render(copy / "overlays" / "hibiki-zero-3b")
    assert one(objects, "StatefulSet")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 1800
    assert env(objects)["DUPLEXSERVE_TERMINATION_GRACE_S"] == "1800"
    rules = one(objects, "PrometheusRule")["spec"]["groups"][0]["rules"]
    assert next(r for r in rules if r.get("alert") == "DuplexserveDrainPastGrace")["for"] == "1800s"


def test_model_per_overlay(rendered) -> None:
    name, objects = rendered
    e = env(objects)
    repo = {"moshi-7b": "kyutai/moshiko-pytorch-bf16@2bfc9ae6e89079a5cc7ed2a68436010d91a3d289",
            "hibiki-2b": "kyutai/hibiki-2b-pytorch-bf16",
            "hibiki-zero-3b": "kyutai/hibiki-zero-3b-pytorch-bf16@23b3e0b41782026c81dd5283a034107b01f9e513",
            "personaplex-7b": "nvidia/personaplex-7b-v1"}[name]
    assert e["DUPLEXSERVE_MOSHI_HF_REPO"] == repo and e["DUPLEXSERVE_MOSHI_WEIGHTS"] == ""
    assert e["DUPLEXSERVE_MODEL"] == name and "DUPLEXSERVE_API_KEYS" not in e  # no key in the env
    pod = one(objects, "StatefulSet")["spec"]["template"]["spec"]
    assert "k8s-test-key" in secret_files(pod)[e["DUPLEXSERVE_API_KEYS_FILE"]].splitlines()
    assert e["DUPLEXSERVE_SERVED_MODEL_NAME"] == name  # any other ?model= refused, not served
    assert (e.get("DUPLEXSERVE_MOSHI_CFG_COEF") == "3") == (name == "hibiki-2b")
    assert (e.get("DUPLEXSERVE_MOSHI_KV_DTYPE") == "int8") == (name == "hibiki-zero-3b")
    assert bool(e.get("DUPLEXSERVE_VOICE_PROMPT_DIR")) == (name == "personaplex-7b")


def test_autoscaler_counts_slots_of_its_own_namespace(rendered) -> None:
    _, objects = rendered
    namespace = one(objects, "Namespace")["metadata"]["name"]
    scaled = one(objects, "ScaledObject")
    assert scaled["spec"]["scaleTargetRef"]["name"] == one(objects, "StatefulSet")["metadata"]["name"]
    trigger = scaled["spec"]["triggers"][0]
    query = trigger["metadata"]["query"]
    assert "NAMESPACE" not in query
    assert set(re.findall(r'namespace="([^"]*)"', query)) == {namespace}
    assert 0 < float(trigger["metadata"]["threshold"]) < 1 and trigger["metricType"] == "Value"
    down = scaled["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
    assert down["stabilizationWindowSeconds"] >= 300
    assert [(p["type"], p["value"]) for p in down["policies"]] == [("Pods", 1)]


def test_gateway_balances_least_request_and_retries_503(rendered) -> None:
    _, objects = rendered
    policy = one(objects, "BackendTrafficPolicy")["spec"]
    assert policy["loadBalancer"]["type"] == "LeastRequest"
    assert 503 in policy["retry"]["retryOn"]["httpStatusCodes"]
    assert policy["timeout"]["http"]["requestTimeout"] == "0s"
    for rule in one(objects, "HTTPRoute")["spec"]["rules"]:
        assert rule["timeouts"]["request"] == "0s"


def test_one_dashboard_for_every_model_in_grafanas_namespace() -> None:
    dashboard = one(render(KUBE / "gateway"), "ConfigMap")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboard["metadata"]["namespace"] == "monitoring"
    assert json.loads(dashboard["data"]["duplexserve.json"])["uid"] == "duplexserve-fleet"


def test_pods_spread_outrank_batch_work_and_take_calls_only_from_the_gateway(rendered) -> None:
    """Issue 75: replicas spread over nodes and zones, carry the shared PriorityClass, and a
    NetworkPolicy admits the API port only from Envoy Gateway's proxies, Prometheus and the
    other replicas (relayed resumes)."""
    _, objects = rendered
    pod = one(objects, "StatefulSet")["spec"]["template"]
    spread = pod["spec"]["topologySpreadConstraints"]
    assert {c["topologyKey"] for c in spread} == {"kubernetes.io/hostname", "topology.kubernetes.io/zone"}
    assert all(c["labelSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items() for c in spread)
    classes = [o for o in render(KUBE / "gateway") if o["kind"] == "PriorityClass"]
    assert [c["metadata"]["name"] for c in classes] == [pod["spec"]["priorityClassName"]]
    policy = one(objects, "NetworkPolicy")["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    tcp = [r for r in policy["ingress"] if "from" in r]
    assert [{p["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"] for p in r["from"]
             if "namespaceSelector" in p} for r in tcp] == [{"envoy-gateway-system", "monitoring"}]
    # the other replicas: a resume relayed to the pod its token names (peer_forward.py)
    peers = [p["podSelector"]["matchLabels"] for p in tcp[0]["from"] if "podSelector" in p]
    assert peers and all(m.items() <= pod["metadata"]["labels"].items() for m in peers)
    assert tcp[0]["ports"] == [{"protocol": "TCP", "port": 8998}]


def test_delete_by_label_keeps_the_namespace(rendered) -> None:
    """docs/deploy-kubernetes.md removes a model with ``kubectl delete -k OVERLAY -l
    app.kubernetes.io/part-of=duplexserve``: that selects every object but the Namespace, whose
    deletion would take the weights claim and the key Secret with it."""
    _, objects = rendered
    selected = {o["kind"] for o in objects
                if o["metadata"].get("labels", {}).get("app.kubernetes.io/part-of") == "duplexserve"}
    assert selected == {o["kind"] for o in objects} - {"Namespace"}
