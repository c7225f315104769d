"""The serving processes' logs: timestamped lines on stderr at a chosen level (`setup_logging`), each of
bounded length: diffusers' pipelines log the part of a prompt their text encoder cuts ("The following
part of your input was truncated ..."), so a long prompt would be copied into the server's log once per
request. Every serving process caps each record's message, and escapes the control characters in it: a
client's path, prompt or id with a newline would otherwise forge a log line of its own (and an escape
sequence paint the operator's terminal). A traceback keeps its lines, each escaped and indented
(`IndentedTracebacks`): the exception's message is as much the client's as the record's."""

from __future__ import annotations

import logging
import re

MAX_LOG_CHARS = 500
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(level: str = "info", process: str | None = None) -> None:
    """`retouch serve` and `retouch worker`: every record at `level` and above on stderr, timestamped and
    named (retouch.access: one line per HTTP answer; retouch.router: workers joining and leaving;
    retouch.node: a worker's edits), capped (`cap_log_messages`). `process`: a tag after the level on
    every line, the worker's name (supervised workers share the head's stderr)."""
    line = LOG_FORMAT if process is None else LOG_FORMAT.replace(
        "%(name)s", f"[{escaped(process).replace('%', '%%')}] %(name)s", 1)
    handler = logging.StreamHandler()
    handler.setFormatter(IndentedTracebacks(line))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    cap_log_messages()


# C0 and C1 controls but the tab, line and paragraph separators, and the bidirectional overrides (which
# reorder how the rest of a line reads)
CONTROL_CHARACTERS = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def escaped(message: str) -> str:
    """`message` on one line, its control characters as Python writes them in a string ("\\n", "\\x1b")."""
    return CONTROL_CHARACTERS.sub(lambda found: repr(found.group())[1:-1], message)


def cap_log_messages(limit: int = MAX_LOG_CHARS) -> None:
    """Cut every log record's message (from any library) after `limit` characters, and escape its control
    characters (`escaped`); a traceback, formatted apart from the message, keeps its lines. Idempotent."""
    previous = logging.getLogRecordFactory()
    if getattr(previous, "retouch_limit", None) is not None:
        return

    def factory(*args, **kwargs) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed record is logging's to report, not ours
            return record
        kept = escaped(message)  # then cut: escapes lengthen it
        if len(kept) > limit:
            kept = f"{kept[:limit]}... [{len(kept) - limit} more characters cut]"
        if kept != message:  # else left as it was made (a formatter may read its args: uvicorn's access log)
            record.msg, record.args = kept, ()
        return record

    factory.retouch_limit = limit
    logging.setLogRecordFactory(factory)


class IndentedTracebacks(logging.Formatter):
    """A formatter whose tracebacks and stacks are indented two spaces, each line escaped (`escaped`): only
    a record's first line starts at the margin, so an exception message with a newline in it (a client's
    file name, say) cannot forge a record of its own."""

    def format(self, record: logging.LogRecord) -> str:
        if not record.exc_info:  # a traceback given only as text (a record made from a dict) stays as it is
            return super().format(record)
        cached, record.exc_text = record.exc_text, None  # another handler's formatter may have cached its own
        try:
            return super().format(record)
        finally:
            record.exc_text = cached

    def formatException(self, exc_info) -> str:
        return indented(super().formatException(exc_info))

    def formatStack(self, stack_info: str) -> str:
        return indented(super().formatStack(stack_info))


def indented(text: str) -> str:
    return "\n".join("  " + escaped(line) for line in text.split("\n"))
