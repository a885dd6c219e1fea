"""The `lmsp-min` command line."""

import argparse
import sys

from lmsp_min import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lmsp-min",
        description="A small LMSP 1.0 local model service with a numpy GGUF engine.",
    )
    parser.add_argument("--version", action="version", version=f"lmsp-min {__version__}")
    parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
