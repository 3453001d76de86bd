#!/usr/bin/env python3
"""One duplexserve replica per GPU behind nginx, from one setting: the list of GPUs.

docker/compose.yaml has two replicas (`--profile scale`); this writes an override with one per
GPU in DUPLEXSERVE_GPUS (indices or UUIDs, comma-separated) and the nginx site listing them all,
into docker/gpus/ (git-ignored). No file of the repository is edited. From the repository root:

    DUPLEXSERVE_GPUS=0,1,2,3 scripts/compose-gpus.py
    docker compose -f docker/compose.yaml -f docker/gpus/compose.yaml --profile scale up -d

Replica i is `duplexserve` (i = 0) or `duplexserve-i` on GPU number i of the list. With --cpu
the replicas are compose.cpu.yaml's (the CPU image, no GPU), each published on the host at
DUPLEXSERVE_PUBLISH_PORT_i (default 127.0.0.1:8998 + i); add compose.cpu.yaml before the override.
One GPU needs none of this: `DUPLEXSERVE_GPU=3 docker compose -f docker/compose.yaml up -d`.
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import yaml

DOCKER = Path(__file__).resolve().parent.parent / "docker"
#: The upstream block's server lines in docker/nginx/duplexserve.conf (one per replica).
SERVER_LINE = re.compile(r"^([ \t]*)server duplexserve(-\d+)?:8998 (.*)$", re.MULTILINE)
#: Each replica's own upstream, and the line of the resume map that routes its tokens there.
REPLICA_UPSTREAM = re.compile(
    r"^([ \t]*)upstream replica-duplexserve(-\d+)? \{ server duplexserve(-\d+)?:8998; \}$", re.MULTILINE
)
RESUME_ROUTE = re.compile(r"^([ \t]*)~\^duplexserve(-\d+)?\\\. replica-duplexserve(-\d+)?;$", re.MULTILINE)


def replica_name(index: int) -> str:
    return "duplexserve" if index == 0 else f"duplexserve-{index}"


def merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """compose's merge of a service: mappings merge key by key, anything else is replaced."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = merged(out[key], value) if both else value
    return out


class Model(NamedTuple):
    """The model of one replica (--models): the name ?model= routes on, and its settings."""

    name: str
    env: dict[str, str]


def replica(index: int, gpu: str, cpu: bool) -> dict[str, Any]:
    """The whole service of a replica past the two that compose.yaml defines."""
    services = yaml.safe_load((DOCKER / "compose.yaml").read_text())["services"]
    service = copy.deepcopy(services["duplexserve-1"])  # the anchors resolved: x-server, profile scale
    if cpu:
        cpu_services = yaml.safe_load((DOCKER / "compose.cpu.yaml").read_text())["services"]
        service = merged(service, cpu_services["duplexserve-1"])
        service["ports"] = [f"${{DUPLEXSERVE_PUBLISH_PORT_{index}:-127.0.0.1:{8998 + index}}}:8998"]
    service["environment"]["NVIDIA_VISIBLE_DEVICES"] = gpu
    service["environment"]["DUPLEXSERVE_REPLICA_ID"] = replica_name(index)
    return service


def compose_override(
    gpus: list[str], cpu: bool, site: Path, models: list[Model] | None = None
) -> dict[str, Any]:
    services: dict[str, Any] = {}
    for index, gpu in enumerate(gpus):
        if index < 2:  # compose.yaml has these two: only their GPU changes
            services[replica_name(index)] = {"environment": {"NVIDIA_VISIBLE_DEVICES": gpu}}
        else:
            services[replica_name(index)] = replica(index, gpu, cpu)
        if models:
            services[replica_name(index)]["environment"].update(models[index].env)
        # Live migration on drain: every replica is a peer of the others (it leaves itself out).
        services[replica_name(index)]["environment"]["DUPLEXSERVE_PEERS"] = ",".join(
            replica_name(i) for i in range(len(gpus)))
    services["lb"] = {
        # Relative to docker/, where compose resolves the paths of every file: no host path in it.
        "volumes": [f"./{os.path.relpath(site.resolve(), DOCKER)}:/etc/nginx/conf.d/default.conf:ro"],
        "depends_on": {replica_name(i): {"condition": "service_healthy"} for i in range(len(gpus))},
    }
    return {"services": services}


def expand(site: str, line: re.Pattern[str], render: Callable[[str, str], str], names: list[str]) -> str:
    """``site`` with the lines ``line`` matches (one per replica) replaced by a line per name,
    ``render(indent, name)`` each, where the first of them was."""
    first = line.search(site)
    if first is None:
        raise SystemExit(f"docker/nginx/duplexserve.conf: no line like {line.pattern!r}")
    lines = "\n".join(render(first.group(1), name) for name in names)
    rest = re.sub(r"\n" + line.pattern[1:], "", site[first.end():], flags=re.MULTILINE)
    return site[:first.start()] + lines + rest


def nginx_site(count: int, models: list[str] | None = None) -> str:
    """docker/nginx/duplexserve.conf with, per replica, a server line in its pool, an upstream
    of its own and a line routing its resume tokens there. ``models`` (the model of each
    replica): the pool ``duplexserve`` holds the first model's replicas (the default, and
    ``?model=`` of it), each other model a pool ``model-NAME`` that ``?model=NAME`` goes to."""
    site = (DOCKER / "nginx" / "duplexserve.conf").read_text()
    found = SERVER_LINE.search(site)
    if found is None:
        raise SystemExit("docker/nginx/duplexserve.conf: no 'server duplexserve:8998 ...' line")
    indent, options = found.group(1), found.group(3)
    names = [replica_name(i) for i in range(count)]
    models = models or [""] * count

    def pool(model: str) -> list[str]:
        return [n for n, m in zip(names, models, strict=True) if m == model]

    site = expand(site, SERVER_LINE, lambda ind, name: f"{ind}server {name}:8998 {options}", pool(models[0]))
    site = expand(site, REPLICA_UPSTREAM,
                  lambda ind, name: f"{ind}upstream replica-{name} {{ server {name}:8998; }}", names)
    site = expand(site, RESUME_ROUTE, lambda ind, name: f"{ind}~^{name}\\. replica-{name};", names)
    others = list(dict.fromkeys(m for m in models if m != models[0]))
    if models[0]:
        block = re.search(r"^upstream duplexserve \{.*?^\}\n", site, flags=re.MULTILINE | re.DOTALL)
        assert block is not None
        pools = "".join(
            f"\nupstream model-{m} {{\n{indent}least_conn;\n{indent}zone model-{m} 64k;\n"
            + "".join(f"{indent}server {n}:8998 {options}\n" for n in pool(m)) + "}\n"
            for m in others
        )
        site = site[:block.end()] + pools + site[block.end():]
        default = "    default duplexserve;\n"
        assert site.count(default) == 1
        routes = [f"    {models[0]} duplexserve;\n", *(f"    {m} model-{m};\n" for m in others)]
        site = site.replace(default, default + "".join(routes))
    return site


def parse_models(text: str, count: int) -> list[Model]:
    """``--models``: one ``NAME=REPO[@REVISION][;VAR=VALUE...]`` per GPU, comma-separated."""
    models = []
    for entry in (e.strip() for e in text.split(",")):
        head, *settings = entry.split(";")
        name, _, repo = head.partition("=")
        if not re.fullmatch(r"[a-z0-9][a-z0-9.-]*", name) or not repo:
            raise ValueError(f"{entry!r}: not NAME=REPO (NAME of lowercase letters, digits, '.' and '-')")
        # The replica serves its name only: a request nginx sent it for another model (one no
        # pool serves goes to the first's) is refused model_not_found, never served by this one.
        env = {"DUPLEXSERVE_MODEL": name, "DUPLEXSERVE_SERVED_MODEL_NAME": name,
               "DUPLEXSERVE_MOSHI_HF_REPO": repo, "DUPLEXSERVE_MOSHI_WEIGHTS": ""}
        for setting in settings:
            var, eq, value = setting.partition("=")
            if not eq or not var.startswith("DUPLEXSERVE_"):
                raise ValueError(f"{setting!r}: not DUPLEXSERVE_VAR=VALUE")
            env[var] = value
        models.append(Model(name, env))
    if len(models) != count:
        raise ValueError(f"{len(models)} models for {count} GPUs: name one per GPU")
    return models


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gpus", default=os.environ.get("DUPLEXSERVE_GPUS", ""),
                        help="GPU indices or UUIDs, comma-separated (default: $DUPLEXSERVE_GPUS)")
    parser.add_argument("--cpu", action="store_true", help="replicas on the CPU image (compose.cpu.yaml)")
    parser.add_argument("--models", default=os.environ.get("DUPLEXSERVE_GPU_MODELS", ""),
                        help="several models: one NAME=REPO[@REVISION][;DUPLEXSERVE_VAR=VALUE...] per GPU, "
                        "comma-separated; nginx routes ?model=NAME to its replicas, no ?model= to the "
                        "first's "
                        "(default: $DUPLEXSERVE_GPU_MODELS)")
    parser.add_argument("--out", type=Path, default=DOCKER / "gpus")
    args = parser.parse_args()
    gpus = [g.strip() for g in args.gpus.split(",") if g.strip()]
    if len(gpus) < 2:
        print("compose-gpus: name two or more GPUs (DUPLEXSERVE_GPUS=0,1); for one, set DUPLEXSERVE_GPU "
              "and use docker/compose.yaml as it is", file=sys.stderr)
        return 2
    if len(set(gpus)) != len(gpus):
        print(f"compose-gpus: a GPU named twice in {args.gpus}", file=sys.stderr)
        return 2
    try:
        models = parse_models(args.models, len(gpus)) if args.models else None
    except ValueError as exc:
        print(f"compose-gpus: --models {exc}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / ".gitignore").write_text("*\n")
    header = (f"# Written by scripts/compose-gpus.py for GPUs {','.join(gpus)}"
              f"{' (CPU replicas)' if args.cpu else ''}: do not edit, run it again.\n")
    (args.out / "compose.yaml").write_text(
        header + yaml.safe_dump(
            compose_override(gpus, args.cpu, args.out / "duplexserve.conf", models),
            sort_keys=False, width=1000,
        )
    )
    names = [m.name for m in models] if models else None
    (args.out / "duplexserve.conf").write_text(header + nginx_site(len(gpus), names))
    print(f"{args.out}/compose.yaml: {len(gpus)} replicas; {args.out}/duplexserve.conf: the upstreams")
    return 0


if __name__ == "__main__":
    sys.exit(main())
