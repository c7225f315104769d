import logging
import os
import signal
import shutil
import subprocess
import sys
import tempfile
import warnings

import pytest
import torch

# Triton kernels run on the CPU under the interpreter; it must be chosen before kernels are defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# No hub, ever.
os.environ["HF_HUB_OFFLINE"] = "1"


def share_cores_among_test_processes() -> None:
    """Under pytest-xdist, give each test process (and the CLI, server and helper processes its tests
    start) its share of the cores. Each at torch's default runs an OpenMP team as wide as the machine:
    two test processes on 2 cores then spin 4 threads against each other, and model tests took 3-4x
    their time alone (stop 40's note)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers < 2:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // workers)
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)  # torch's default in the subprocesses, which inherit it


def pytest_configure(config):
    share_cores_among_test_processes()
    # One folder of exported built-in models per test process (each xdist worker, and the controller,
    # which leaves it empty), shared with CLI subprocesses: each model is built and saved once there, then
    # every test loads it with from_pretrained.
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


def interpreter_warning_filters() -> None:
    """Python's own default filters (a release build without -W), which pytest replaces around each test."""
    warnings.resetwarnings()
    warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")
    for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
        warnings.filterwarnings("ignore", category=category)


def show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


@pytest.fixture
def cli_here(capfd, monkeypatch):
    """Run `retouch ARGS` in this interpreter: for the many tests of what the CLI refuses, where a fresh
    one adds only seconds of imports. As in a terminal, whatever would reach stderr does: records through
    logging's last resort (pytest's own handlers are set aside), Python warnings, and the log lines of
    diffusers' and transformers' handlers; an exception escaping `main` fails the test as a traceback would.
    The process-wide state `main` sets (logging, the record factory, signal handlers) is put back."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    import retouch.cli

    def run(*args: str, cwd=None) -> subprocess.CompletedProcess:
        if cwd is not None:
            monkeypatch.chdir(cwd)
        capfd.readouterr()
        root = logging.getLogger()
        handlers, level, factory = root.handlers[:], root.level, logging.getLogRecordFactory()
        signals = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
        library_handlers = [library._get_library_root_logger().handlers for library in
                            (diffusers_logging, transformers_logging)]
        streams = [(handler, handler.stream) for group in library_handlers for handler in group
                   if type(handler) is logging.StreamHandler]
        for handler, _ in streams:  # not setStream: it flushes the old stream, maybe a closed capture's
            handler.stream = sys.stderr
        root.handlers[:] = []
        try:
            with warnings.catch_warnings():  # the interpreter's filters, shown on stderr, as outside pytest
                interpreter_warning_filters()
                warnings.showwarning = show_warning
                code = retouch.cli.main([str(arg) for arg in args])
        except SystemExit as exc:  # argparse's refusals
            code = exc.code
        finally:
            for handler in root.handlers:  # `serve`'s, on this capture's stderr, which closes with the test
                handler.close()
            root.handlers[:], root.level = handlers, level
            logging.setLogRecordFactory(factory)
            for signum, handler in signals.items():
                signal.signal(signum, handler)
            for handler, stream in streams:
                handler.stream = stream
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
