"""The `specsuite` command: one subcommand per app, plus model provisioning and the benchmark."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# Each command's module has `register(subparsers)`, adding the command with `func=` handlers that
# return an exit code.
COMMANDS = {"models": "specsuite.models_cli", "bench": "specsuite.bench.cli", "bench-ray": "specsuite.bench.ray_job",
            "step-cost": "specsuite.step_cost", "gec": "specsuite.apps.gec.cli", "rag": "specsuite.apps.rag.cli",
            "serve": "specsuite.apps.serving.cli", "bench-openai": "specsuite.bench.openai_server",
            "eval": "specsuite.apps.eval_cli", "train": "specsuite.training.cli"}


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser of every command; where `argv` names one, of that command only: its module alone
    is imported, so that a command that refuses its input does so before torch is even loaded."""
    parser = argparse.ArgumentParser(prog="specsuite", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    first = next((a for a in argv or [] if not a.startswith("-")), None)
    for name in [COMMANDS[first]] if first in COMMANDS else COMMANDS.values():
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
