"""`mbufo` command line. Each subcommand lives in its own module and registers itself here.

Conventions: `--json` prints exactly one compact JSON object on the last line of stdout;
progress and logs go to stderr. Engine errors, and the database's storage failing (a full
disk, a read-only or damaged file), exit with status 2 and a one-line message.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable

from appliance.cli import bench_command, engine_commands, serve_command, state_commands

# order matters: serve_command adds `models load|unload` beside the registry's `models`
COMMAND_MODULES = [engine_commands, state_commands, serve_command, bench_command]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mbufo", description="mbufo: a mixed-batch LLM appliance for a shared box")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging on stderr")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMAND_MODULES:
        module.register(sub)
    return parser


def emit_json(obj: dict) -> None:
    """The last line of stdout: one compact JSON object."""
    sys.stdout.write(json.dumps(obj, separators=(",", ":"), ensure_ascii=False) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    if not args.verbose:  # library chatter (migration plugins, HTTP clients) only with -v
        for name in ("alembic", "httpx", "httpcore"):
            logging.getLogger(name).setLevel(logging.WARNING)
    handler: Callable[[argparse.Namespace], int] = args.handler
    from engine.errors import EngineError

    try:
        return handler(args) or 0
    except EngineError as exc:
        print(f"mbufo: error ({exc.code}): {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        from appliance.db import STORAGE_CODE, storage_failure

        reason = storage_failure(exc)
        if reason is None:
            raise
        print(f"mbufo: error ({STORAGE_CODE}): {_where(args)}{reason}; free space (or "
              f"mend the file) and run it again", file=sys.stderr)
        return 2


def _where(args: argparse.Namespace) -> str:
    """'the database at PATH (N MiB free on its disk): ', or '' when the settings do not
    name it."""
    import shutil

    from appliance.settings import load_settings

    try:
        settings = load_settings({"data_dir": getattr(args, "data_dir", None)},
                                 config=getattr(args, "config", None))
        path = settings.database_path
        free = shutil.disk_usage(path.parent).free >> 20
    except Exception:  # noqa: BLE001 - the message still says what failed
        return ""
    return f"the database at {path} ({free} MiB free on its disk): "


if __name__ == "__main__":
    sys.exit(main())
