#!/usr/bin/env python3
"""Vendor the OpenAPI schemas of the CRDs that deploy/kubernetes uses, for the offline tests.

tests/test_kubernetes.py validates every rendered object of a custom kind (KEDA, Gateway API,
Envoy Gateway, Prometheus Operator) against its CRD's schema, so that a misspelt field fails
in CI rather than at `kubectl apply`. Only the schema of each served version is kept, without
its descriptions (the CRD files are megabytes of prose). Pass the CRD YAML files, taken from
the projects' releases (the versions are in deploy/kubernetes/schemas/SOURCES.md):

    scripts/vendor-crd-schemas.py keda.sh_scaledobjects.yaml gateway.networking.k8s.io_httproutes.yaml ...
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import yaml

OUT = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes" / "schemas"


def strip(node: Any) -> Any:
    """The schema without prose: descriptions carry no constraint."""
    if isinstance(node, dict):
        return {k: strip(v) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [strip(v) for v in node]
    return node


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("crds", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    for path in args.crds:
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc or doc.get("kind") != "CustomResourceDefinition":
                continue
            spec = doc["spec"]
            for version in spec["versions"]:
                if not version.get("served"):
                    continue
                target = args.out / spec["group"] / f"{spec['names']['kind']}_{version['name']}.json"
                target.parent.mkdir(parents=True, exist_ok=True)
                schema = strip(version["schema"]["openAPIV3Schema"])
                target.write_text(json.dumps(schema, indent=1, sort_keys=True) + "\n")
                print(f"{target.relative_to(args.out)}: {target.stat().st_size} bytes")


if __name__ == "__main__":
    main()
