"""`specsuite models ...`: list and fetch the model presets."""

from __future__ import annotations

import argparse
import sys

from .models import PRESETS, ProvisioningError, cache_dir, provision


def _list(args: argparse.Namespace) -> int:
    for p in PRESETS.values():
        state = "ready" if (cache_dir() / "models" / p.name / "specsuite-preset.json").exists() else "not fetched"
        print(f"{p.name:14} {state:12} {p.description}")
    print(f"cache: {cache_dir()}  (set SPECSUITE_CACHE to move it)")
    return 0


def _fetch(args: argparse.Namespace) -> int:
    try:
        for name in args.names:
            print(provision(name))
    except ProvisioningError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="list or fetch the model presets")
    msub = p.add_subparsers(dest="models_command", required=True)
    msub.add_parser("list", help="presets and whether they are in the cache").set_defaults(func=_list)
    f = msub.add_parser("fetch", help="download, verify and convert presets")
    f.add_argument("names", nargs="+", choices=sorted(PRESETS))
    f.set_defaults(func=_fetch)
