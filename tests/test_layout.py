"""Imports go down only: each part of duplexserve imports only the parts the package map allows.

The rules are the map at the top of docs/architecture.md (its "May import" column), so
the map and the code cannot drift apart. Every import counts, also those inside
functions (the lazy ones) and under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import duplexserve

PACKAGE = Path(duplexserve.__file__).resolve().parent
MAP = PACKAGE.parent / "docs" / "architecture.md"


def package_map(text: str) -> dict[str, set[str]]:
    """Part -> the parts it may import, from the map's table rows (``| part | holds | may import |``)."""
    rows = [line.split("|")[1:-1] for line in text.splitlines() if line.startswith("| `")]
    names = [re.findall(r"`([^`]+?)(?:\.py|/)`", first) for first, _, _ in rows]
    every = {name for row in names for name in row}
    rules: dict[str, set[str]] = {}
    for row, (_, _, may) in zip(names, rows, strict=True):
        may = re.sub(r"\([^)]*\)", "", may).strip()  # asides name flags, not parts
        allowed = every if may == "everything" else set(re.findall(r"`(\w+)`", may))  # "nothing": none
        for name in row:
            rules[name] = allowed - {name}
    return rules


def part_of(module: str) -> str | None:
    """``duplexserve.server.app`` -> ``server``, ``duplexserve.errors`` -> ``errors``; None outside.

    None also for the root's own names (``duplexserve.__version__``): any part may read them.
    """
    names = module.split(".")
    if names[0] != "duplexserve" or len(names) < 2:
        return None
    part = names[1]
    return part if (PACKAGE / part).is_dir() or (PACKAGE / f"{part}.py").is_file() else None


def module_name(path: Path) -> str:
    names = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(names[:-1] if names[-1] == "__init__" else names)


def imported(module: str, is_package: bool, source: str) -> list[tuple[int, str]]:
    """Every module ``source`` imports, as (line, absolute name); ``from a import b`` gives ``a.b``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: len(module.split(".")) - node.level + is_package]
                base = ".".join([*anchor, base] if base else anchor)
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def violations(rules: dict[str, set[str]], path: Path, source: str) -> list[str]:
    module = module_name(path)
    part = part_of(module) or ""
    bad = []
    for line, target in imported(module, path.name == "__init__.py", source):
        other = part_of(target)
        if other is not None and other != part and other not in rules.get(part, set()):
            bad.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {part} imports {target}")
    return bad


def modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p != PACKAGE / "__init__.py")  # the root: a version


def test_every_part_is_on_the_map():
    rules = package_map(MAP.read_text())
    parts = {part_of(module_name(p)) for p in modules()}
    assert parts - set(rules) == set(), "add these to the map in docs/architecture.md"
    assert set(rules) - parts == set(), "the map in docs/architecture.md names parts that do not exist"


def test_imports_go_down_only():
    rules = package_map(MAP.read_text())
    bad = [v for path in modules() for v in violations(rules, path, path.read_text())]
    assert bad == []


def test_the_serving_path_imports_neither_loadgen_nor_bench():
    rules = package_map(MAP.read_text())
    for part in ("server", "engine_bridge", "codecs", "config", "errors", "testing"):
        assert rules[part] & {"loadgen", "bench"} == set(), part
    assert "server" not in rules["engine_bridge"]
    assert rules["codecs"] & {"server", "engine_bridge"} == set()


def test_an_upward_import_inside_a_function_is_caught():
    rules = package_map(MAP.read_text())
    path = PACKAGE / "engine_bridge" / "vllm_omni" / "events.py"
    lazy = "def f():\n    from duplexserve.server import errors\n"
    relative = "from ...server.errors import SessionError\n"
    assert violations(rules, path, lazy) == [
        "duplexserve/engine_bridge/vllm_omni/events.py:2: engine_bridge imports duplexserve.server.errors"
    ]
    assert violations(rules, path, relative) == [
        "duplexserve/engine_bridge/vllm_omni/events.py:1: engine_bridge imports duplexserve.server.errors."
        "SessionError"
    ]
    assert violations(rules, path, "from duplexserve import errors\n") == []


# ---------------------------------------------------------------- server/'s layers
#: server/'s layers (docs/architecture.md, "server/ in layers"): what each may import
#: of server/. The session core imports only itself; a protocol imports the core (the
#: transport interface is core/transport.py), never a transport; a transport imports the
#: core, never a protocol, nor another transport. ``helpers``: the modules at server/'s
#: root that hold no wiring (request parsing, log hygiene), free to every layer but the core.
HELPERS = {"auth", "log_redaction", "http_errors", "request_body", "served_models"}
LAYER_RULES = {
    "core": {"core"},
    "protocols": {"core", "protocols", *HELPERS},
    "transports.websocket": {"core", "transports.websocket", *HELPERS},
    "transports.webrtc": {"core", "transports.webrtc", *HELPERS},
}


def layer_of(module: str) -> str | None:
    """``duplexserve.server.transports.webrtc.call`` -> ``transports.webrtc``; ``...server.app``
    -> ``app``; None outside server/."""
    names = module.split(".")
    if names[:2] != ["duplexserve", "server"] or len(names) < 3:
        return None
    if names[2] == "transports" and len(names) > 3:
        return f"transports.{names[3]}"
    return names[2]


def layer_violations(path: Path, source: str) -> list[str]:
    module = module_name(path)
    layer = layer_of(module)
    allowed = LAYER_RULES.get(layer or "")
    if allowed is None:
        return []
    bad = []
    for line, target in imported(module, path.name == "__init__.py", source):
        other = layer_of(target)
        if other is not None and other not in allowed and target != "duplexserve.server.__init__":
            bad.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {layer} imports {target}")
    return bad


def test_server_layers():
    assert {layer_of(module_name(p)) for p in (PACKAGE / "server").rglob("*.py")} >= set(LAYER_RULES)
    bad = [v for path in modules() for v in layer_violations(path, path.read_text())]
    assert bad == []


def test_a_layer_crossing_is_caught():
    core = PACKAGE / "server" / "core" / "session.py"
    protocol = PACKAGE / "server" / "protocols" / "native.py"
    transport = PACKAGE / "server" / "transports" / "webrtc" / "call.py"
    assert layer_violations(core, "def f():\n    from duplexserve.server.protocols import native\n") == [
        "duplexserve/server/core/session.py:2: core imports duplexserve.server.protocols.native"
    ]
    assert layer_violations(core, "from duplexserve.server import auth\n") == [
        "duplexserve/server/core/session.py:1: core imports duplexserve.server.auth"
    ]
    assert layer_violations(protocol, "from ..transports.websocket.fast import FastPath\n") == [
        "duplexserve/server/protocols/native.py:1: protocols imports "
        "duplexserve.server.transports.websocket.fast.FastPath"
    ]
    assert layer_violations(transport, "from duplexserve.server.protocols.realtime import adapter\n") != []
    assert layer_violations(transport, "from duplexserve.server.transports.websocket import frames\n") != []
    assert layer_violations(protocol, "from duplexserve.server.core.transport import Transport\n") == []


# ---------------------------------------------------------------- file sizes
#: The session core is read most and changed most carefully: each of its files stays small
#: enough to read whole (the brief's ~400 lines); a file that grows past it is split by
#: what it holds (as core/admission.py and core/sweeper.py left core/orchestrator.py).
CORE_MAX_LINES = 400


def test_the_session_core_files_stay_under_400_lines():
    sizes = {p.name: len(p.read_text().splitlines()) for p in (PACKAGE / "server" / "core").glob("*.py")}
    assert {name: n for name, n in sizes.items() if n > CORE_MAX_LINES} == {}
