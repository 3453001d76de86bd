"""``duplexserve`` command line: ``serve``, ``check`` (and the tools registered beside them)."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from duplexserve.check import model_source
from duplexserve.check.requirements import INSTALL_MOSHI, MOSHI_NEEDS
from duplexserve.config import ServerConfig
from duplexserve.engine_bridge.moshi.presets import preset_note
from duplexserve.options import settle
from duplexserve.subcommands import DefaultsHelpFormatter, LazyParser, from_module

#: The optional packages a command may import, by the pyproject.toml extra that installs
#: them; a command missing one says so in one line instead of a traceback.
EXTRAS = {"rich": "loadgen", "matplotlib": "loadgen", "picows": "bench", "aiortc": "webrtc", "av": "webrtc"}
#: The benchmarks' extra holds the load generator's too.
BENCH_HOLDS = ("loadgen",)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="duplexserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=LazyParser)
    sub.add_parser(
        "serve",
        help="run the WebSocket server",
        description="Serve full-duplex speech sessions over WebSocket. Every flag also "
        "reads an environment variable, named in its help.",
        define=serve_options,  # the variables read, and refused, only when serve is chosen
    )
    sub.add_parser("check", help="what this machine and these options give, without serving "
                   "(paste it into a bug report)", define=from_module("duplexserve.check.command"))
    sub.add_parser("loadgen", help="drive a server with sessions and measure it",
                   formatter_class=DefaultsHelpFormatter,
                   define=from_module("duplexserve.loadgen.command"))
    sub.add_parser("bench", help="run a benchmark (docs/benchmarks.md)",
                   formatter_class=argparse.RawDescriptionHelpFormatter,
                   define=from_module("duplexserve.bench.command"))
    sub.add_parser("proxy-exporter", help="count what the compose deployment's nginx answered callers, "
                   "for Prometheus", define=from_module("duplexserve.proxy_exporter.command"))
    args = parser.parse_args(argv)
    if args.command in ("serve", "check"):
        try:  # MODEL: the settings it stands for
            model_source.apply(args)
        except ValueError as exc:
            print(f"duplexserve {args.command}: {exc}", file=sys.stderr)
            return 2
    try:
        if args.command == "serve":
            return serve(args)
        module = importlib.import_module(f"duplexserve.{args.command.replace('-', '_')}.command")
        return int(module.run(args) or 0)
    except ModuleNotFoundError as exc:
        line = missing(args.command, exc)
        if line is None:
            raise
        print(line, file=sys.stderr)
        return 2


def serve_options(parser: argparse.ArgumentParser) -> None:
    ServerConfig.add_arguments(parser, notes={"moshi_preset": preset_note()})
    model_source.add_model_argument(parser)


def serve(args: argparse.Namespace) -> int:
    config = settle(args, "duplexserve serve")
    try:
        config.validate()
        if config.api_keys_file:  # read again by the server, which keeps watching it
            from duplexserve.server.key_file import read_keys

            read_keys(config.api_keys_file)
    except ValueError as exc:  # one line: the top-level usage would say nothing of serve's options
        print(f"duplexserve serve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from duplexserve.check.preflight import CannotServe, preflight
    from duplexserve.listen import listen_socket
    from duplexserve.server.run import serve as run_server

    try:  # before the preflight and the model's load: a busy port is said at once
        sock = listen_socket(config.host, config.port)
    except OSError as exc:
        print(f"duplexserve: cannot listen on {config.host}:{config.port}: {exc.strerror or exc} "
              "(another server there? --port picks another)", file=sys.stderr)
        return 1
    try:  # MODEL, a repository: what the cache lacks is downloaded (model_source.py)
        model_source.fetch(args)
    except model_source.CannotFetch as exc:
        sock.close()
        print(f"duplexserve serve: {exc}", file=sys.stderr)
        return 2
    try:
        config = preflight(config)
    except CannotServe as exc:
        sock.close()
        logging.getLogger("duplexserve").debug("preflight", exc_info=True)  # --log-level debug only
        print(f"duplexserve: {exc}", file=sys.stderr)
        return 1
    run_server(config, sock)
    return 0


def missing(command: str, exc: ModuleNotFoundError) -> str | None:
    """The line for an optional package ``command`` needs and this environment lacks (None:
    not a package of anyone's: a module of duplexserve's own, a bug, keeps its traceback)."""
    module = (exc.name or "").partition(".")[0]
    if not module or module == "duplexserve":
        return None
    if module in MOSHI_NEEDS:
        fix = INSTALL_MOSHI
    elif module in EXTRAS:
        extra = EXTRAS[module]
        extra = "bench" if command == "bench" and extra in BENCH_HOLDS else extra
        fix = f"pip install -e '.[{extra}]'"
    elif module in ("vllm", "vllm_omni"):
        fix = "run it from vLLM-Omni's venv, made by scripts/test-vllm-omni.sh (docs/vllm-omni.md)"
    else:
        fix = "pip install -e '.[test]' installs every optional package but the engines'"
    return f"duplexserve {command}: needs {module}, not installed in {sys.prefix}; {fix}"


if __name__ == "__main__":
    sys.exit(main())
