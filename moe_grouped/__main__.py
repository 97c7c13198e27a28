"""``python -m moe_grouped info``: report what this installation has."""

from __future__ import annotations

import argparse
import json
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_grouped")
    sub = parser.add_subparsers(dest="command", required=True)
    info_parser = sub.add_parser("info", help="versions, core build state, GPUs and backends")
    info_parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    from .info import collect, format_facts

    facts = collect()
    print(json.dumps(facts, indent=2) if args.json else format_facts(facts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
