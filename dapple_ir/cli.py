"""The `dapple` command. Each subcommand lives in `dapple_ir/commands/<name>.py` and calls the API."""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import select
import sys
import traceback

from dapple_ir import __version__, commands
from dapple_ir.errors import DappleError

#: Subcommands `dapple --help` lists first, in this order; any other module in `dapple_ir.commands`
#: follows in name order.
FIRST_COMMANDS = ("compile", "simulate", "run", "dump", "opt", "passes", "profile", "calibrate")


def command_names() -> list[str]:
    found = {m.name for m in pkgutil.iter_modules(commands.__path__)}
    return [n for n in FIRST_COMMANDS if n in found] + sorted(found - set(FIRST_COMMANDS))


_EPILOG = """examples:
  dapple passes
  dapple opt model.dapple -p 'dce,verify' --print-ir-after-all
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dapple",
        description="dapple-ir: compile PyTorch models into synchronous pipeline-parallel plans.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"dapple-ir {__version__}")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in command_names():
        importlib.import_module(f"dapple_ir.commands.{name}").register(sub)
    return parser


#: The status `dapple` ends with when what reads its output closed the pipe (128 + SIGPIPE, as a shell reports it).
CLOSED_PIPE_STATUS = 141


def _stdout_closed() -> bool:
    """Whether standard output is a pipe whose reader has gone (poll reports an error on its write end)."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poll.poll(0))
    except (AttributeError, ValueError, OSError):
        return False


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        status = int(args.func(args) or 0)
        sys.stdout.flush()  # a reader that went away (`| head`) shows here, not at the interpreter's exit
        return status
    except BrokenPipeError as exc:
        if not _stdout_closed():
            return _internal_error(exc, args.debug)
        # As other command-line tools end on a closed pipe: quietly, with the status of a process killed by SIGPIPE.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush has nowhere to fail
        return CLOSED_PIPE_STATUS
    except DappleError as exc:
        if args.debug:
            traceback.print_exc()
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        return _internal_error(exc, args.debug)


def _internal_error(exc: Exception, debug: bool) -> int:
    if debug:
        traceback.print_exception(exc)
    print(
        f"internal error: {type(exc).__name__}: {exc}. This is a bug in dapple-ir; rerun with "
        "--debug for the traceback and report it.",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
