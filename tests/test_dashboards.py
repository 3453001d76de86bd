"""The fleet's dashboard, alerts and autoscaler query against real Prometheus tools.

- scripts/dashboards.py --check: the dashboard JSON in the repo is the generator's.
- promtool (Debian's `prometheus` package): the PrometheusRule of a rendered overlay passes
  `promtool check rules`, and `promtool test rules` runs deploy/kubernetes/tests/rules-test.yaml
  (each alert firing and not firing).
- A real Prometheus scrapes a real server on loopback while `duplexserve loadgen` drives it;
  every dashboard panel's query, every alert's expression and the autoscaler's query then
  names only metrics the server exports, and every panel's query returns data.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import websockets.sync.client
import yaml

from tests.conftest import ServerProcess, free_port
from tests.test_kubernetes import KUBE, ROOT, one, render, require_tool

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
DASHBOARDS = ROOT / "scripts" / "dashboards.py"
sys.path.insert(0, str(ROOT / "scripts"))
import dashboards  # noqa: E402

METRIC = re.compile(r"\b(duplexserve_[a-z0-9_]+)")


def rule_groups(tmp: Path) -> Path:
    """The overlay's PrometheusRule as a Prometheus rule file."""
    rule = one(render(KUBE / "overlays" / "hibiki-zero-3b"), "PrometheusRule")
    path = tmp / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}, sort_keys=False))
    return path


def test_dashboard_json_is_the_generators() -> None:
    assert subprocess.run([sys.executable, str(DASHBOARDS), "--check"]).returncode == 0


def test_dashboard_check_fails_on_a_stale_file(tmp_path) -> None:
    stale = tmp_path / "d.json"
    stale.write_text(dashboards.render().replace("Slots in use", "Slots used"))
    assert subprocess.run([sys.executable, str(DASHBOARDS), "--check", "--out", str(stale)]).returncode == 1


def test_rules_check_and_unit_tests(tmp_path) -> None:
    require_tool(PROMTOOL, "promtool (Debian package prometheus)")
    rules = rule_groups(tmp_path)
    check = subprocess.run([PROMTOOL, "check", "rules", str(rules)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    shutil.copy(KUBE / "tests" / "rules-test.yaml", tmp_path)
    unit = subprocess.run([PROMTOOL, "test", "rules", "rules-test.yaml"], cwd=tmp_path,
                          capture_output=True, text=True)
    assert unit.returncode == 0, unit.stdout + unit.stderr


def test_rule_unit_tests_fail_when_an_alert_changes(tmp_path) -> None:
    """The unit tests pin each alert: a threshold moved makes `promtool test rules` fail."""
    require_tool(PROMTOOL, "promtool (Debian package prometheus)")
    rules = rule_groups(tmp_path)
    rules.write_text(rules.read_text().replace("> 0.9", "> 0.95"))
    shutil.copy(KUBE / "tests" / "rules-test.yaml", tmp_path)
    unit = subprocess.run([PROMTOOL, "test", "rules", "rules-test.yaml"], cwd=tmp_path,
                          capture_output=True, text=True)
    assert unit.returncode != 0 and "DuplexserveFleetNearFull" in unit.stdout + unit.stderr


@pytest.fixture(scope="module")
def scraped(tmp_path_factory) -> Iterator[tuple[str, ServerProcess]]:
    """Prometheus (1 s scrapes) on a server that `duplexserve loadgen` has driven."""
    require_tool(PROMETHEUS, "prometheus (Debian package prometheus)")
    from tests.conftest import start_server

    tmp = tmp_path_factory.mktemp("prom")
    server = start_server(str(tmp), "--max-sessions", "8")
    port = free_port()
    config = tmp / "prometheus.yml"
    config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "duplexserve",
                            "static_configs": [{"targets": [f"127.0.0.1:{server.port}"]}]}],
    }))
    with open(tmp / "prometheus.log", "wb") as log:
        prom = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        load = subprocess.run(
            [sys.executable, "-m", "duplexserve", "loadgen", server.ws().rsplit("/v1", 1)[0],
             "--concurrency", "4", "--sessions", "8", "--warmup", "0", "--seconds", "4",
             "--expect", "echo", "--no-progress"], capture_output=True, text=True, timeout=120)
        assert load.returncode == 0, load.stdout + load.stderr
        # Scrapes before and after the load, so that rates span it.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                r = httpx.get(url + "/api/v1/query", params={"query": "duplexserve_sessions_accepted_total"})
                result = r.json()["data"]["result"] if r.status_code == 200 else []
                if result and float(result[0]["value"][1]) >= 8:
                    break
            time.sleep(0.5)
        else:
            pytest.fail("Prometheus never scraped the load: " + (tmp / "prometheus.log").read_text()[-2000:])
        time.sleep(3)
        yield url, server
    finally:
        prom.terminate()
        prom.wait(30)
        server.stop()


def panel_queries() -> list[tuple[str, str]]:
    """(panel title, query) for every target, with Grafana's variables as a user would see them."""
    return [
        (p["title"], t["expr"].replace("$__rate_interval", "1m").replace("$namespace", ".*"))
        for p in dashboards.dashboard()["panels"] for t in p["targets"]
    ]


def queries_without_data(prometheus: str, queries: list[tuple[str, str]]) -> list[str]:
    empty = []
    for title, query in queries:
        r = httpx.get(prometheus + "/api/v1/query", params={"query": query}, timeout=10)
        assert r.status_code == 200, f"{title}: {query}: {r.text}"
        if not r.json()["data"]["result"]:
            empty.append(f"{title}: {query}")
    return empty


def test_every_panel_returns_data(scraped) -> None:
    prometheus, _ = scraped
    assert queries_without_data(prometheus, panel_queries()) == []


def test_a_panel_naming_a_missing_metric_is_caught(scraped) -> None:
    """The check above has teeth: a renamed metric returns no data and is reported."""
    prometheus, _ = scraped
    title, query = panel_queries()[0]
    wrong = query.replace("duplexserve_max_sessions", "duplexserve_sessions_max")
    assert queries_without_data(prometheus, [(title, wrong)]) == [f"{title}: {wrong}"]


def test_every_query_names_exported_metrics(scraped) -> None:
    """Dashboard, alerts and autoscaler: each duplexserve_* name is one the server exports."""
    _, server = scraped
    exported = {METRIC.match(line).group(1) for line in httpx.get(server.http + "/metrics").text.splitlines()
                if METRIC.match(line)}
    objects = render(KUBE / "overlays" / "hibiki-zero-3b")
    texts = [q for _, q in panel_queries()]
    texts += [r["expr"] for r in one(objects, "PrometheusRule")["spec"]["groups"][0]["rules"]]
    texts += [t["metadata"]["query"] for t in one(objects, "ScaledObject")["spec"]["triggers"]]
    named = {m for text in texts for m in METRIC.findall(text)}
    assert {"duplexserve_max_sessions", "duplexserve_draining", "duplexserve_sessions_active"} <= named
    assert named - exported == set()


def test_autoscaler_query_is_the_fraction_of_slots_in_use(scraped) -> None:
    """The ScaledObject's query on the live server: one session open of 8 slots is 0.125."""
    prometheus, server = scraped
    trigger = one(render(KUBE / "overlays" / "hibiki-zero-3b"), "ScaledObject")["spec"]["triggers"][0]
    query = re.sub(r'namespace="[^"]*"', 'job="duplexserve"', trigger["metadata"]["query"])
    values: list[float] = []
    with websockets.sync.client.connect(server.ws()) as ws:
        assert json.loads(ws.recv(timeout=10))["type"] == "session.created"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and values != [0.125]:
            r = httpx.get(prometheus + "/api/v1/query", params={"query": query}, timeout=10)
            values = [float(x["value"][1]) for x in r.json()["data"]["result"]]
            time.sleep(0.5)
    assert values == [0.125]
