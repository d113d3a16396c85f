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


MAX_LOG_LINE = 2000
MAX_LOG_RECORD = 20000


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


class BoundedFormatter(logging.Formatter):
    """Log records cut to MAX_LOG_LINE characters a line and MAX_LOG_RECORD in all: a message or
    a traceback may quote what a client sent (a grammar, a prompt), megabytes of it."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        lines = [
            line if len(line) <= MAX_LOG_LINE else f"{line[:MAX_LOG_LINE]}... [{len(line)} chars]"
            for line in text.split("\n")
        ]
        text = "\n".join(lines)
        return text if len(text) <= MAX_LOG_RECORD else f"{text[:MAX_LOG_RECORD]}... [cut]"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if next((a for a in argv if not a.startswith("-")), None) in MODEL_COMMANDS:
        from inferflow.kernel_build import prebuild  # no torch: before the parser imports it

        prebuild()
    args = build_parser().parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:
        handler.setFormatter(BoundedFormatter("%(levelname)s %(name)s: %(message)s"))
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
