"""A long prompt is not copied into the log: diffusers' own truncation warning is cut short."""

from __future__ import annotations

import logging

import pytest
from diffusers.utils import logging as diffusers_logging

from retouch.log_limits import MAX_LOG_CHARS, cap_log_messages


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
