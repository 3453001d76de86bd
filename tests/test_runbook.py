"""Every alert links its runbook entry: each rule of every PrometheusRule under deploy/kubernetes
and of docker/prometheus/alerts.yml has a ``runbook_url`` annotation into docs/runbook.md whose
anchor is one of its headings, named for the alert. An alert added without its entry, or an entry
renamed, fails here."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
RUNBOOK = ROOT / "docs" / "runbook.md"
URL = re.compile(r"^https://github\.com/OWNER/duplexserve/blob/main/docs/runbook\.md#([a-z0-9-]+)$")


def anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as dashes."""
    return {re.sub(r"[^a-z0-9 -]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#{1,6} (.+)$", markdown, re.M)}


def alerts() -> list[dict[str, Any]]:
    found = []
    for path in sorted((ROOT / "deploy" / "kubernetes").rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and doc.get("kind") == "PrometheusRule":
                found += [r for g in doc["spec"]["groups"] for r in g["rules"] if "alert" in r]
    # The compose deployment's rule file (docker/prometheus/prometheus.yml loads it).
    compose = yaml.safe_load((ROOT / "docker" / "prometheus" / "alerts.yml").read_text())
    return found + [r for g in compose["groups"] for r in g["rules"] if "alert" in r]


def test_every_alert_links_its_runbook_entry() -> None:
    known = anchors(RUNBOOK.read_text())
    rules = alerts()
    assert len(rules) >= 9
    faults = []
    for rule in rules:
        url = rule.get("annotations", {}).get("runbook_url", "")
        match = URL.match(url)
        if match is None:
            faults.append(f"{rule['alert']}: runbook_url {url!r} is not an anchor of docs/runbook.md")
        elif match.group(1) != rule["alert"].lower() or match.group(1) not in known:
            faults.append(f"{rule['alert']}: docs/runbook.md has no heading for #{match.group(1)}")
    assert faults == []


def test_the_overload_alerts_have_entries_too() -> None:
    """The overload manager's alerts (DuplexserveOverloaded, DuplexserveShedding) have entries
    whether or not their rules are in this tree yet."""
    assert {"duplexserveoverloaded", "duplexserveshedding"} <= anchors(RUNBOOK.read_text())


def test_anchors_follow_github() -> None:
    assert anchors("## DuplexserveSessionsRefused\n### Updates without an outage\n") == {
        "duplexservesessionsrefused", "updates-without-an-outage"}
