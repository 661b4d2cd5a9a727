"""pytest's cache of test modules with their asserts rewritten, kept where bytecode is not
written (PYTHONDONTWRITEBYTECODE, as on these machines). pytest honours that setting for its
own cache too, so every process of every run (each xdist worker) parsed and rewrote every test
module again: 2 of the 4.3 s of CPU a worker of `make test-fast` took to collect. The cache is
pytest's (`__pycache__/*-pytest-*.pyc`, checked against each source's size and time); bytecode
is written only while tests are collected, so what the tests import is left as configured."""

from __future__ import annotations

import sys
from collections.abc import Generator

import pytest


@pytest.hookimpl(wrapper=True)
def pytest_collection() -> Generator[None, object, object]:
    configured = sys.dont_write_bytecode
    sys.dont_write_bytecode = False
    try:
        return (yield)
    finally:
        sys.dont_write_bytecode = configured
