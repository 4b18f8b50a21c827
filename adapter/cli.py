"""`arbiter serve`, `arbiter entrypoint` (the container's ENTRYPOINT) and `arbiter openapi`. Imports
stay light: what a command needs is loaded only when it runs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    Subcommands = argparse._SubParsersAction[argparse.ArgumentParser]


def cmd_serve(args: argparse.Namespace) -> int:
    from adapter.serve import serve

    return serve(host=args.host, port=args.port, model=args.model)


def cmd_entrypoint(args: argparse.Namespace) -> int:
    from adapter.entrypoint import main

    return main(args.args)


def cmd_openapi(args: argparse.Namespace) -> int:
    from adapter import openapi
    from adapter.app import ROUTES

    if openapi.write(ROUTES, check=args.check):
        print(f"{openapi.PATH.name} is {'up to date' if args.check else 'written'}")
        return 0
    print(f"{openapi.PATH.name} is out of date: run arbiter openapi", file=sys.stderr)
    return 1


def register(sub: Subcommands) -> None:
    serve = sub.add_parser(
        "serve", help="run the HTTP server (SageMaker /ping + /invocations, chat, metrics)"
    )
    serve.add_argument(
        "--host",
        default=None,
        help="interface (default ARBITER_HOST, else 127.0.0.1; the container sets 0.0.0.0)",
    )
    serve.add_argument("--port", type=int, default=None, help="port (default: env, else 8080)")
    serve.add_argument("--model", type=Path, default=None, help="a .gguf (else ARBITER_MODEL...)")
    serve.set_defaults(func=cmd_serve)

    entrypoint = sub.add_parser(
        "entrypoint",
        help="the container entrypoint: check the model and the build, then exec serve or work",
    )
    entrypoint.add_argument(
        "args", nargs=argparse.REMAINDER, help="serve|work and their options (`IMAGE serve`)"
    )
    entrypoint.set_defaults(func=cmd_entrypoint)

    document = sub.add_parser(
        "openapi", help="write adapter/openapi.json from the route table and the wire models"
    )
    document.add_argument("--check", action="store_true", help="only fail if it is out of date")
    document.set_defaults(func=cmd_openapi)
