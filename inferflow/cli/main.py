"""The ``inferflow`` console script: one module per subcommand, each a thin layer over the library."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from inferflow.errors import InferflowError

SUBCOMMANDS = (
    "serve",
    "generate",
    "chat",
    "embed",
    "classify",
    "translate",
    "validate",
    "inspect",
    "ppl",
    "convert",
    "quantize",
    "imatrix",
    "plan",
)
# commands that run a model: their C kernels are compiled (where not yet cached) while torch
# and the model load, not one after the other
MODEL_COMMANDS = frozenset(
    {"serve", "generate", "chat", "embed", "classify", "translate", "ppl", "imatrix"}
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="inferflow", description="Configuration-driven transformer inference."
    )
    p.add_argument(
        "-v", "--verbose", action="count", default=0, help="more logging (-v info, -vv debug)"
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(f"inferflow.cli.{name}").add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if next((a for a in argv if not a.startswith("-")), None) in MODEL_COMMANDS:
        from inferflow.kernel_build import prebuild  # no torch: before the parser imports it

        prebuild()
    args = build_parser().parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.run(args) or 0)
    except InferflowError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
