"""What the Kubernetes manifests let through the front door, and what Envoy logs (issue 75).

The Gateway's proxies log through the EnvoyProxy of deploy/kubernetes/gateway: no query string
(``?token=`` holds the API key of clients that cannot set a header, ``?resume=`` a resume token)
and no header that may carry a key. The routes take only the API: nothing internal (metrics, the
API's schema and its pages) is routed to the replicas.
"""

from __future__ import annotations

import re

from tests.test_kubernetes import KUBE, OVERLAYS, one, render

#: Paths the replicas answer that callers have no business with. Not /ready: the talk page reads
#: the engine from it and, when a call fails, why (issue 75: routed).
INTERNAL = {"/metrics", "/docs", "/redoc", "/openapi.json", "/health", "/internal/v1/move"}
#: Request headers that may carry a key or a session's token.
SECRET_HEADERS = {"authorization", "proxy-authorization", "cookie", "sec-websocket-protocol", "x-api-key"}


def test_the_gateways_access_log_holds_no_query_and_no_key_header() -> None:
    objects = render(KUBE / "gateway")
    proxy = one(objects, "EnvoyProxy")
    ref = one(objects, "Gateway")["spec"]["infrastructure"]["parametersRef"]
    assert (ref["group"], ref["kind"], ref["name"]) == ("gateway.envoyproxy.io", "EnvoyProxy",
                                                        proxy["metadata"]["name"])
    settings = proxy["spec"]["telemetry"]["accessLog"]["settings"]
    assert settings and not proxy["spec"]["telemetry"]["accessLog"].get("disable")
    for setting in settings:
        fmt = setting["format"]
        texts = [fmt["text"]] if fmt["type"] == "Text" else list(fmt["json"].values())
        for text in texts:
            assert "%PATH" not in text  # Envoy's %PATH% operator logs the query unless told not to
            for operands in re.findall(r"%(?:REQ|REQUEST_HEADER)\(([^)]*)\)", text):
                names = {name.split(":", 1)[-1].lower() if name.startswith(":") else name.lower()
                         for name in re.split(r"\?", operands)}
                assert "path" not in names, f"{operands}: the path with its query (?token=, ?resume=)"
                assert not names & SECRET_HEADERS, f"{operands}: a header that may carry a key"
        assert text.endswith("\n") if fmt["type"] == "Text" else True  # one entry a line


def test_no_route_reaches_an_internal_path() -> None:
    routes = [o for o in render(KUBE / "gateway") if o["kind"] == "HTTPRoute"]
    for overlay in OVERLAYS:
        routes += [o for o in render(KUBE / "overlays" / overlay) if o["kind"] == "HTTPRoute"]
    for route in routes:
        for rule in route["spec"]["rules"]:
            if not rule.get("backendRefs"):
                continue  # a redirect: it sends nothing to a replica
            assert rule.get("matches"), f"{route['metadata']['name']}: a rule that takes every path"
            for match in rule["matches"]:
                path, value = match["path"]["type"], match["path"]["value"]
                if path == "Exact":
                    taken = {value} & INTERNAL
                else:
                    assert path == "PathPrefix", f"{route['metadata']['name']}: {path} paths"
                    taken = {p for p in INTERNAL if p == value or p.startswith(value.rstrip("/") + "/")}
                assert not taken, f"{route['metadata']['name']} routes {sorted(taken)} ({path} {value})"
