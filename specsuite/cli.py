"""The `specsuite` command: one subcommand per app, plus model provisioning and the benchmark."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# Each module has `register(subparsers)`, adding its subcommands with `func=` handlers that return an exit code.
COMMAND_MODULES = ["specsuite.models_cli", "specsuite.bench", "specsuite.bench_ray", "specsuite.step_cost", "specsuite.apps.gec.cli", "specsuite.apps.rag.cli",
                   "specsuite.apps.server_cli", "specsuite.bench_openai",
                   "specsuite.apps.eval_cli"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specsuite", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
