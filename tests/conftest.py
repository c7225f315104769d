import logging
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch

# Triton kernels run on the CPU under the interpreter; it must be chosen before kernels are defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# No hub, ever.
os.environ["HF_HUB_OFFLINE"] = "1"


def pytest_configure(config):
    # One folder of exported built-in models for the whole run, shared with CLI subprocesses:
    # each model is built and saved once, then every test loads it with from_pretrained.
    config._retouch_cache = tempfile.mkdtemp(prefix="retouch-test-models-")
    os.environ["RETOUCH_CACHE_DIR"] = config._retouch_cache


def pytest_unconfigure(config):
    shutil.rmtree(getattr(config, "_retouch_cache", ""), ignore_errors=True)


def run_cli(*args: str, env: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
    """Run `retouch ARGS` in a fresh interpreter, as a user would."""
    return subprocess.run([sys.executable, "-m", "retouch.cli", *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, cwd=cwd, timeout=600)


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture
def cli_here(capfd, monkeypatch):
    """Run `retouch ARGS` in this interpreter: for the many tests of what the CLI refuses, where a fresh
    one adds only seconds of imports. Output is captured at the file descriptors, so a library's log line
    counts as it would in a terminal; an exception escaping `main` fails the test as a traceback would."""
    from retouch.cli import main

    def run(*args: str, cwd=None) -> subprocess.CompletedProcess:
        if cwd is not None:
            monkeypatch.chdir(cwd)
        capfd.readouterr()
        root = logging.getLogger()
        handlers, level = root.handlers[:], root.level
        try:
            code = main([str(arg) for arg in args])
        except SystemExit as exc:  # argparse's refusals
            code = exc.code
        finally:
            # `serve` sets up logging on this capture's stderr, which closes with the test
            for handler in set(root.handlers) - set(handlers):
                handler.close()
            root.handlers[:], root.level = handlers, level
        out, err = capfd.readouterr()
        return subprocess.CompletedProcess(["retouch", *map(str, args)], code, out, err)

    return run


@pytest.fixture
def context():
    """A ZeroMQ context for scripted workers (`scripted_worker.ScriptedWorker`), destroyed after."""
    import zmq

    context = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def make_router():
    """Routers on loopback, closed after the test (those it did not close itself):
    `make_router(cost=StepCost or None, **RouterConfig fields)`."""
    from retouch.engine.router import Router, RouterConfig

    routers = []

    def make(cost=None, **config) -> Router:
        config = {"address": "tcp://127.0.0.1:0", "policy": "least-requests", "heartbeat_s": 0.05,
                  "dead_after_s": 60.0, **config}
        routers.append(Router(RouterConfig(**config), cost).start())
        return routers[-1]

    yield make
    for router in routers:
        router.close(drain_s=0)
