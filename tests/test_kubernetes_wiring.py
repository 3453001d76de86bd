"""deploy/kubernetes: every object finds the one it points at, in every overlay as rendered.

A manifest can validate and still select nothing: a ServiceMonitor whose selector no Service
carries scrapes nothing, and then the autoscaler, the alerts and the dashboard see nothing. So
for every overlay (and the shared Gateway, deploy/kubernetes/gateway) :func:`faults` checks each
link: Service -> pods, ServiceMonitor -> Service and its port, PDB and ScaledObject -> the
workload, HTTPRoute -> the Gateway's listener (which must admit the overlay's namespace) and ->
a Service with that port, BackendTrafficPolicy -> the route, the route's ?model= -> the name the
server answers to, no route to /metrics or the API docs, and every alert and autoscaler query
names only metrics a real server exports (its /metrics, read here), each of the overlay's own
namespace. :func:`test_each_broken_link_is_caught` breaks each link once.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from duplexserve.server.app import PROTOCOLS
from tests.conftest import start_server
from tests.test_kubernetes import KUBE, OVERLAYS, container_env, one, render

Objects = list[dict[str, Any]]
METRIC = re.compile(r"\b(duplexserve_[a-z0-9_]+)(\{[^}]*\})?")
#: What the Gateway must not route: Prometheus scrapes the pods, the kubelet probes them.
PRIVATE = ("/metrics", "/docs", "/redoc", "/openapi.json", "/health", "/internal/v1/move")
#: What a client asks a model for, so the model's rule must take each (with ?model=): the
#: WebSocket protocols, WebRTC's calls, hangup and ICE servers, and /ready (the talk page asks
#: it before a WebRTC call). A phone call's model is in its path: /v1/twilio/MODEL.
PUBLIC = (*PROTOCOLS, "/v1/realtime/calls", "/v1/realtime/calls/rtc_0/hangup", "/v1/realtime/ice_servers",
          "/v1/realtime/client_secrets", "/v1/models", "/ready", "/")
#: kube-prometheus-stack's selector label, as docs/deploy-kubernetes.md installs the stack.
RELEASE = {"release": "kube-prometheus-stack"}


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> set[str]:
    """The metric families a real server exports (histograms as their _bucket, _sum, _count)."""
    server = start_server(str(tmp_path_factory.mktemp("wiring")), "--max-sessions", "2")
    try:
        text = httpx.get(server.http + "/metrics", timeout=10).text
    finally:
        server.stop()
    return {m.group(1) for line in text.splitlines() if (m := METRIC.match(line))}


@pytest.fixture(scope="module")
def gateway() -> Objects:
    return render(KUBE / "gateway")


@pytest.fixture(scope="module")
def overlays() -> dict[str, Objects]:
    return {name: render(KUBE / "overlays" / name) for name in OVERLAYS}


def selects(selector: dict[str, str], labels: dict[str, str] | None) -> bool:
    return bool(selector) and all((labels or {}).get(k) == v for k, v in selector.items())


def matches(match: dict[str, Any], path: str) -> bool:
    kind, value = match["path"]["type"], match["path"]["value"]
    return path == value if kind == "Exact" else path.startswith(value)


def query_faults(where: str, text: str, namespace: str, exported: set[str]) -> list[str]:
    found = []
    for name, labels in METRIC.findall(text):
        if name not in exported:
            found.append(f"{where}: {name} is not a metric the server exports")
        if f'namespace="{namespace}"' not in labels:
            found.append(f"{where}: {name} is not scoped to namespace {namespace}")
    return found


def faults(objects: Objects, gateway: Objects, exported: set[str]) -> list[str]:
    """Every broken link of one overlay's objects (empty: all wired)."""
    found: list[str] = []
    namespace = one(objects, "Namespace")["metadata"]
    ns = namespace["name"]
    deployment = one(objects, "StatefulSet")
    pods = deployment["spec"]["template"]["metadata"]["labels"]
    service = one(objects, "Service", "duplexserve")
    monitor = one(objects, "ServiceMonitor")
    rules = one(objects, "PrometheusRule")
    route = one(objects, "HTTPRoute")

    if not selects(deployment["spec"]["selector"]["matchLabels"], pods):
        found.append("StatefulSet: its selector does not select its own pods")
    if not selects(service["spec"]["selector"], pods):
        found.append("Service: selects no pod of the StatefulSet")
    if not selects(monitor["spec"]["selector"]["matchLabels"], service["metadata"].get("labels")):
        found.append("ServiceMonitor: selects no Service")
    ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    if not all(e.get("port") in ports for e in monitor["spec"]["endpoints"]):
        found.append("ServiceMonitor: names a port the Service does not have")
    for kind, obj in (("ServiceMonitor", monitor), ("PrometheusRule", rules)):
        if not selects(RELEASE, obj["metadata"].get("labels")):
            found.append(f"{kind}: no release label, kube-prometheus-stack's Prometheus ignores it")
    if not selects(one(objects, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"], pods):
        found.append("PodDisruptionBudget: covers no pod of the StatefulSet")
    target = one(objects, "ScaledObject")["spec"]["scaleTargetRef"]
    if target.get("kind", "Deployment") != "StatefulSet" or target["name"] != deployment["metadata"]["name"]:
        found.append("ScaledObject: scales no workload of the overlay")

    # The route: attached to the shared Gateway's HTTPS listener, which admits this namespace.
    gw = one(gateway, "Gateway")
    for parent in route["spec"]["parentRefs"]:
        listener = next((x for x in gw["spec"]["listeners"] if x["name"] == parent.get("sectionName")), None)
        gateway_ref = (gw["metadata"]["name"], gw["metadata"]["namespace"])
        if (parent["name"], parent.get("namespace")) != gateway_ref or listener is None \
                or listener["protocol"] != "HTTPS":
            found.append("HTTPRoute: attached to no HTTPS listener of the shared Gateway")
        elif not selects(listener["allowedRoutes"]["namespaces"]["selector"]["matchLabels"],
                         namespace.get("labels")):
            found.append("HTTPRoute: the Gateway's listener does not admit the overlay's namespace")
    for rule in route["spec"]["rules"]:
        for ref in rule["backendRefs"]:
            if ref["name"] != service["metadata"]["name"] or ref["port"] not in ports.values():
                found.append(f"HTTPRoute: backend {ref['name']}:{ref['port']} is no Service port")
        for path in PRIVATE:
            if any(matches(m, path) for m in rule["matches"]):
                found.append(f"HTTPRoute: routes {path} through the Gateway")
    server_env = container_env(deployment["spec"]["template"]["spec"]["containers"][0])
    model = server_env["DUPLEXSERVE_MODEL"]
    found += peer_faults(objects, server_env)
    if server_env.get("DUPLEXSERVE_SERVED_MODEL_NAME") != model:  # else it serves any ?model= sent to it
        found.append(f"StatefulSet: DUPLEXSERVE_SERVED_MODEL_NAME is not {model!r}, the only model it serves")
    by_model = next((r for r in route["spec"]["rules"] if r.get("name") == "model"), {"matches": []})
    asked = {q["value"] for m in by_model["matches"] for q in m.get("queryParams", [])
             if q["name"] == "model"}
    if asked != {model}:
        found.append(f"HTTPRoute: routes ?model={sorted(asked)} to a server of {model!r}")
    for path in PUBLIC:
        if not any(matches(m, path) for m in by_model["matches"]):
            found.append(f"HTTPRoute: does not route {path}?model={model}")
    if not any(matches(m, f"/v1/twilio/{model}") and "queryParams" not in m
               for r in route["spec"]["rules"] for m in r["matches"]):
        found.append(f"HTTPRoute: does not route /v1/twilio/{model}")
    if not any(t["name"] == route["metadata"]["name"]
               for t in one(objects, "BackendTrafficPolicy")["spec"]["targetRefs"]):
        found.append("BackendTrafficPolicy: applies to no route of the overlay")

    for r in rules["spec"]["groups"][0]["rules"]:
        found += query_faults(f"alert {r['alert']}", r["expr"], ns, exported)
    for t in one(objects, "ScaledObject")["spec"]["triggers"]:
        found += query_faults("ScaledObject", t["metadata"]["query"], ns, exported)
    return found


def peer_faults(objects: Objects, server_env: dict[str, str]) -> list[str]:
    """Resume with no affinity: each pod reachable by its name (the replica id of its tokens)
    through a headless Service that lists it even while not ready."""
    found: list[str] = []
    stateful = one(objects, "StatefulSet")
    headless = one(objects, "Service", stateful["spec"].get("serviceName"))
    spec, pods = headless["spec"], stateful["spec"]["template"]["metadata"]["labels"]
    if spec.get("clusterIP") != "None" or not spec.get("publishNotReadyAddresses") or not selects(
            spec["selector"], pods):
        found.append("headless Service: not headless, hides pods not ready, or selects no pod")
    ns = one(objects, "Namespace")["metadata"]["name"]
    port = next(p["port"] for p in spec["ports"] if p["name"] == "http")
    url = server_env.get("DUPLEXSERVE_PEER_URL_TEMPLATE", "")
    if "POD_NAMESPACE" in server_env:  # the kubelet puts the pod's namespace in its place
        url = url.replace("$(POD_NAMESPACE)", ns)
    if url != f"ws://{{replica}}.{headless['metadata']['name']}.{ns}.svc:{port}":
        found.append(f"StatefulSet: DUPLEXSERVE_PEER_URL_TEMPLATE {url!r} names no pod of the headless "
                     "Service")
    replica = server_env.get("DUPLEXSERVE_REPLICA_ID")
    if replica != "duplexserve-0" or not server_env.get("DUPLEXSERVE_PEER_SECRET"):
        found.append("StatefulSet: the replica id is not the pod's name, or no peer secret")
    return found


def test_every_overlay_is_wired(overlays: dict[str, Objects], gateway: Objects, exported: set[str]) -> None:
    assert {name: faults(objects, gateway, exported) for name, objects in overlays.items()} == {
        name: [] for name in overlays}


def test_one_default_model_taking_the_same_paths(overlays: dict[str, Objects]) -> None:
    """Requests without ?model= go to exactly one overlay, on the paths of every model's rule
    and the talk page's /static."""
    defaults = {}
    for name, objects in overlays.items():
        rules = {r["name"]: r for r in one(objects, "HTTPRoute")["spec"]["rules"]}
        paths = [m["path"] for m in rules["model"]["matches"]]
        if "default" in rules:
            defaults[name] = [m["path"] for m in rules["default"]["matches"]]
            assert all("queryParams" not in m for m in rules["default"]["matches"])
            assert defaults[name] == [*paths, {"type": "PathPrefix", "value": "/static"}]
    assert list(defaults) == ["hibiki-zero-3b"]


def test_dashboard_queries_name_exported_metrics_of_the_chosen_namespaces(gateway: Objects,
                                                                          exported: set[str]) -> None:
    dashboard = json.loads(one(gateway, "ConfigMap")["data"]["duplexserve.json"])
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            for name, labels in METRIC.findall(target["expr"]):
                assert name in exported, (panel["title"], name)
                assert 'namespace=~"$namespace"' in labels, (panel["title"], name)


def _relabel_service(o: Objects) -> None:
    one(o, "Service", "duplexserve")["metadata"]["labels"] = {"app.kubernetes.io/part-of": "duplexserve"}


def _rename(kind: str, *path: str | int) -> Callable[[Objects], None]:
    def go(o: Objects) -> None:
        node: Any = one(o, kind)
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = "renamed"
    return go


def _unlabel(kind: str) -> Callable[[Objects], None]:
    def go(o: Objects) -> None:
        one(o, kind)["metadata"]["labels"].pop("release")
    return go


def _route_all(o: Objects) -> None:
    one(o, "HTTPRoute")["spec"]["rules"][0]["matches"].append({"path": {"type": "PathPrefix", "value": "/"}})


def _rule_expr(change: Callable[[str], str]) -> Callable[[Objects], None]:
    def go(o: Objects) -> None:
        rule = one(o, "PrometheusRule")["spec"]["groups"][0]["rules"][0]
        rule["expr"] = change(rule["expr"])
    return go


def _port(o: Objects) -> None:
    one(o, "HTTPRoute")["spec"]["rules"][0]["backendRefs"][0]["port"] = 8999


def _namespace_label(o: Objects) -> None:
    one(o, "Namespace")["metadata"]["labels"] = {}


def _unserve(o: Objects) -> None:
    """No --served-model-name: the default route's requests for unserved models would be served."""
    container = one(o, "StatefulSet")["spec"]["template"]["spec"]["containers"][0]
    container["env"] = [v for v in container["env"] if v["name"] != "DUPLEXSERVE_SERVED_MODEL_NAME"]


BREAKS: dict[str, tuple[Callable[[Objects], None], str]] = {
    "the Service's labels (issue 68)": (_relabel_service, "ServiceMonitor: selects no Service"),
    "the Service's selector": (lambda o: one(o, "Service", "duplexserve")["spec"]["selector"].update(
        {"app.kubernetes.io/name": "other"}), "Service: selects no pod"),
    "the ServiceMonitor's port": (lambda o: one(o, "ServiceMonitor")["spec"]["endpoints"][0].update(
        port="metrics"), "ServiceMonitor: names a port"),
    "the ServiceMonitor's release label": (_unlabel("ServiceMonitor"), "ServiceMonitor: no release label"),
    "the PrometheusRule's release label": (_unlabel("PrometheusRule"), "PrometheusRule: no release label"),
    "the PDB's selector": (lambda o: one(o, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"].update(
        {"app.kubernetes.io/name": "other"}), "PodDisruptionBudget: covers no pod"),
    "the scaler's target": (_rename("ScaledObject", "spec", "scaleTargetRef", "name"),
                            "ScaledObject: scales no"),
    "the route's backend": (_port, "is no Service port"),
    "the route's listener": (lambda o: one(o, "HTTPRoute")["spec"]["parentRefs"][0].update(
        sectionName="http"), "attached to no HTTPS listener"),
    "the namespace's label": (_namespace_label, "does not admit the overlay's namespace"),
    "the route's paths": (_route_all, "routes /metrics through the Gateway"),
    "the route's model": (lambda o: one(o, "HTTPRoute")["spec"]["rules"][0]["matches"][0][
        "queryParams"][0].update(value="other"), "HTTPRoute: routes ?model="),
    "the headless Service": (lambda o: one(o, "Service", "duplexserve-headless")["spec"].pop(
        "publishNotReadyAddresses"), "headless Service: not headless"),
    "the peer URL": (lambda o: one(o, "StatefulSet")["spec"].update(serviceName="duplexserve"),
                     "headless Service: not headless"),
    "the served model name": (_unserve, "DUPLEXSERVE_SERVED_MODEL_NAME is not"),
    "the traffic policy's target": (lambda o: one(o, "BackendTrafficPolicy")["spec"]["targetRefs"][0].update(
        name="other"), "BackendTrafficPolicy: applies to no route"),
    "an alert's metric": (_rule_expr(lambda e: e.replace("_max_sessions", "_sessions_max")),
                          "duplexserve_sessions_max is not a metric"),
    "an alert's namespace": (_rule_expr(lambda e: re.sub(r'\{namespace="[^"]*"\}', "", e)), "is not scoped"),
}


@pytest.mark.parametrize("link", list(BREAKS))
def test_each_broken_link_is_caught(overlays: dict[str, Objects], gateway: Objects, exported: set[str],
                                    link: str) -> None:
    objects = copy.deepcopy(overlays["hibiki-zero-3b"])
    break_it, expected = BREAKS[link]
    break_it(objects)
    found = faults(objects, gateway, exported)
    assert any(expected in f for f in found), found
