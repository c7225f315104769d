"""The step loop run to completion on the test's thread (imported by test modules; pytest puts tests/ on
sys.path), so the order of events is deterministic."""

from retouch.engine.worker import Worker


def run_loop(editor, config, jobs, inject=None, send_to_postprocess=None) -> Worker:
    """`Worker.run` over `jobs` (all in the inbox before it starts) until every one is answered;
    `inject(worker, steps_run)` is called after every step and may put more jobs in the inbox;
    `send_to_postprocess(job)` takes finished edits instead of the loop (as the helpers do)."""
    worker = Worker(editor, config, send_to_postprocess)
    for job in jobs:
        worker.inbox.put(("edit", job))
    step = worker.step

    def step_and_inject():
        stepped = step()
        if inject is not None:
            inject(worker, worker.metrics.steps + 1)
        return stepped

    worker.step = step_and_inject
    worker.inbox.put(("stop",))
    worker.run()
    worker.loras.close()  # its loader thread, if a request named a LoRA
    return worker
