"""A long prompt is not copied into the log: diffusers' own truncation warning is cut short. A client's
text cannot forge a log line: control characters in any message are escaped."""

from __future__ import annotations

import asyncio
import logging
import sys
import unicodedata
from urllib.parse import quote

import httpx
import pytest
from diffusers.utils import logging as diffusers_logging
from hypothesis import given, settings
from hypothesis import strategies as st

from retouch.log_limits import LOG_FORMAT, MAX_LOG_CHARS, IndentedTracebacks, cap_log_messages, escaped


@pytest.fixture
def capped():
    previous = logging.getLogRecordFactory()
    cap_log_messages()
    cap_log_messages()  # twice is once
    yield
    logging.setLogRecordFactory(previous)


def test_library_warnings_with_a_huge_prompt_are_cut(capped, caplog):
    prompt = "a cat " * 200_000  # ~1.2 MB
    logger = diffusers_logging.get_logger("diffusers.pipelines.flux.pipeline_flux")
    logger.propagate = True
    with caplog.at_level(logging.WARNING):
        logger.warning("The following part of your input was truncated because CLIP can only handle sequences "
                       "up to %d tokens: %s", 77, prompt)
        logging.getLogger("short").warning("short and %s", "whole")
    long_record, short_record = caplog.records[-2:]
    assert len(long_record.getMessage()) < MAX_LOG_CHARS + 64 and "more characters cut" in long_record.getMessage()
    assert long_record.getMessage().startswith("The following part of your input was truncated")
    assert short_record.getMessage() == "short and whole"


def is_control(character: str) -> bool:
    """A character that breaks or reorders a log line: a control (but the tab), a line or paragraph
    separator, or a bidirectional override."""
    return (unicodedata.category(character) in ("Cc", "Zl", "Zp") and character != "\t"
            or unicodedata.bidirectional(character) in ("LRE", "RLE", "LRO", "RLO", "PDF", "LRI", "RLI", "FSI", "PDI"))


@settings(max_examples=300, deadline=None)
@given(st.text(st.characters(codec="utf-8")) | st.text(st.characters(max_codepoint=0x206F)))
def test_an_escaped_message_is_one_line_without_control_characters_and_other_text_is_kept(text):
    line = escaped(text)
    assert len(line.splitlines()) <= 1 and not any(is_control(c) for c in line)
    if not any(is_control(c) for c in text):
        assert line == text


def test_a_path_with_a_newline_and_an_escape_sequence_forges_no_access_line(capped, caplog, make_router):
    from retouch.http_api import Limits, create_app

    forged = "x\n2026-11-25 23:59:59,000 INFO retouch.access: POST /v1/edits 200 FORGED\x1b[31m"

    async def visit():
        app = create_app(make_router(), Limits())
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://retouch") as client:
            return await client.get(f"/v1/templates/{quote(forged)}")

    with caplog.at_level(logging.INFO, logger="retouch.access"):
        assert asyncio.run(visit()).status_code == 404
    (line,) = [r.getMessage() for r in caplog.records if r.name == "retouch.access"]
    assert "\n" not in line and "\x1b" not in line and "x\\n2026-11-25" in line and "\\x1b[31m" in line


def test_a_traceback_keeps_its_lines(capped, caplog):
    try:
        raise ValueError("two\nlines")
    except ValueError:
        with caplog.at_level(logging.ERROR):
            logging.getLogger("retouch.test").exception("failed on %s", "a\nb")
    record = caplog.records[-1]
    assert record.getMessage() == "failed on a\\nb"
    assert record.exc_info[0] is ValueError and sys.exc_info() == (None, None, None)
    assert "Traceback" in logging.Formatter().format(record).splitlines()[1]


def test_a_traceback_cannot_forge_a_record(capped, caplog):
    """Every line but a record's first is indented, so a line at the margin is a record: an exception
    message holding a newline and a would-be record stays inside its traceback, escaped."""
    forged = "bad name x\n2026-11-25 23:59:59,000 INFO retouch.access: POST /v1/edits 200 FORGED\x1b[31m"
    try:
        raise ValueError(forged)
    except ValueError:
        with caplog.at_level(logging.ERROR):
            logging.getLogger("retouch.test").exception("failed")
    lines = IndentedTracebacks(LOG_FORMAT).format(caplog.records[-1]).split("\n")
    assert lines[0].endswith("ERROR retouch.test: failed")
    assert all(line.startswith("  ") for line in lines[1:]) and lines[1] == "  Traceback (most recent call last):"
    assert lines[-2:] == ["  ValueError: bad name x", "  2026-11-25 23:59:59,000 INFO retouch.access: POST "
                                                        "/v1/edits 200 FORGED\\x1b[31m"]


def test_a_workers_lines_carry_its_name_escaped(capped):
    from retouch.log_limits import setup_logging

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        setup_logging("info", process="w%d\n0")  # a --name is the operator's text: % and controls stay literal
        record = logging.LogRecord("retouch.node", logging.INFO, __file__, 1, "edit %s done", ("e-1",), None)
        line = root.handlers[0].format(record)
    finally:
        for handler in set(root.handlers) - set(handlers):
            handler.close()
        root.handlers[:], root.level = handlers, level
    assert line.endswith(" INFO [w%d\\n0] retouch.node: edit e-1 done")
