"""``duplexserve`` command line: ``serve``, ``check`` (and the tools registered beside them)."""

from __future__ import annotations

import argparse
import logging
import sys

from duplexserve.config import ServerConfig
from duplexserve.subcommands import LazyParser, from_module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="duplexserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=LazyParser)
    serve_p = sub.add_parser(
        "serve",
        help="run the WebSocket server",
        description="Serve full-duplex speech sessions over WebSocket. Every flag also "
        "reads an environment variable, named in its help.",
    )
    ServerConfig.add_arguments(serve_p)
    sub.add_parser("check", help="what this machine and these options give, without serving "
                   "(paste it into a bug report)", define=from_module("duplexserve.check.command"))
    sub.add_parser("loadgen", help="drive a server with sessions and measure it",
                   define=from_module("duplexserve.loadgen.command"))
    sub.add_parser("bench", help="run a benchmark (docs/benchmarks.md)",
                   formatter_class=argparse.RawDescriptionHelpFormatter,
                   define=from_module("duplexserve.bench.command"))
    args = parser.parse_args(argv)
    if args.command == "loadgen":
        from duplexserve.loadgen import command

        return command.run(args)
    if args.command == "bench":
        from duplexserve.bench import command

        return command.run(args)
    if args.command == "check":
        from duplexserve.check import command

        return command.run(args)
    if args.command == "serve":
        config = ServerConfig.from_namespace(args)
        try:
            config.validate()
        except ValueError as exc:  # one line, not argparse's usage of every flag before it
            print(f"duplexserve serve: error: {exc}", file=sys.stderr)
            return 2
        logging.basicConfig(
            level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
        from duplexserve.check.preflight import CannotServe, preflight

        try:
            config = preflight(config)
        except CannotServe as exc:
            logging.getLogger("duplexserve").debug("preflight", exc_info=True)  # --log-level debug only
            print(f"duplexserve: {exc}", file=sys.stderr)
            return 1
        from duplexserve.server.run import serve

        serve(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
