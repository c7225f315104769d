"""The serving processes' logs: timestamped lines on stderr at a chosen level (`setup_logging`), each of
bounded length: diffusers' pipelines log the part of a prompt their text encoder cuts ("The following
part of your input was truncated ..."), so a long prompt would be copied into the server's log once per
request. Every serving process caps each record's message."""

from __future__ import annotations

import logging

MAX_LOG_CHARS = 500
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(level: str = "info") -> None:
    """`retouch serve` and `retouch worker`: every record at `level` and above on stderr, timestamped and
    named (retouch.access: one line per HTTP answer; retouch.router: workers joining and leaving;
    retouch.node: a worker's edits), capped (`cap_log_messages`)."""
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT, force=True)
    cap_log_messages()


def cap_log_messages(limit: int = MAX_LOG_CHARS) -> None:
    """Cut every log record's message (from any library) after `limit` characters. Idempotent."""
    previous = logging.getLogRecordFactory()
    if getattr(previous, "retouch_limit", None) is not None:
        return

    def factory(*args, **kwargs) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed record is logging's to report, not ours
            return record
        if len(message) > limit:
            record.msg, record.args = f"{message[:limit]}... [{len(message) - limit} more characters cut]", ()
        return record

    factory.retouch_limit = limit
    logging.setLogRecordFactory(factory)
