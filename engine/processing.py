"""Pre- and post-processing of edits, and the helper processes that run it apart from the step loop.

Pre-processing makes an edit ready for the denoiser: the mask at the processing size and its token
indices, the initial latents, then the pipeline's own preparation up to its first denoiser call (text
encoding, VAE encoding of the masked image, mask latents, schedule). Post-processing decodes the
final latents with the VAE, crops the canvas to the template's size and pastes the template's pixels
wherever the request's mask is 0 (`retouch.editor.finish`).

In the disaggregated mode both run in helper processes (`python -m retouch.engine.processing`),
each with its own copy of the pipeline's text encoders and VAE on the worker's device, so the step
loop only ever sees ready tensors. Messages are `retouch.engine.wire` frames over ZeroMQ PUSH/PULL
on ipc:// sockets: msgpack headers and raw bytes, never pickle.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import zmq
from PIL import Image

from retouch.canvas import Canvas
from retouch.editor import EditInputs, EditRequest, MaskAwareEditor, Template, finish
from retouch.engine import recipes, wire
from retouch.engine.process_tree import HELPERS_DIR_PREFIX, child_env, die_with_parent, remove_stale_run_dirs
from retouch.engine.recipes import Prepared
from retouch.log_limits import cap_log_messages
from retouch.lora import LoraChoice, LoraError, parse_lora
from retouch.lora.text_encoders import TextEncoderLoras, TextEncoderUses

logger = logging.getLogger("retouch.helpers")


@dataclass
class ReadyEdit:
    """An edit after pre-processing: what the step loop needs of it."""

    inputs: EditInputs
    prepared: Prepared


def preprocess(editor: MaskAwareEditor, request: EditRequest, template: Template,
               text_encoder_lora: TextEncoderUses = ()) -> ReadyEdit:
    """`text_encoder_lora`: the text-encoder parts of the edit's LoRA adapters (`TextEncoderLoras.of`)."""
    inputs = editor.prepare_edit(request, template)
    return ReadyEdit(inputs, recipes.prepare(editor, inputs, request.prompt, request.strength, request.negative_prompt,
                                             request.guidance, text_encoder_lora))


def prepare_recording(editor: MaskAwareEditor, template: Template, records: bool = True,
                      strength: float = 1.0) -> ReadyEdit:
    """A template's recorded run made ready for the loop (`MaskAwareEditor.prepare_recording`). Below
    `strength` 1 it runs the last steps only, so it answers a one-off edit and records nothing."""
    if records and strength < 1.0:
        raise ValueError("a recording runs every step of its schedule (strength 1)")
    inputs = editor.prepare_recording(template, records)
    return ReadyEdit(inputs, recipes.prepare(editor, inputs, template.prompt, strength, template.negative_prompt))


def postprocess(editor: MaskAwareEditor, template: Template, mask: Image.Image, latents: torch.Tensor) -> Image.Image:
    """`mask`: the request's, at the template's size (`MaskAwareEditor.check_request`)."""
    return finish(template, recipes.decode(editor, latents, template.canvas.padded)[0], mask)


# ---- what crosses the process boundary ----

def _image_blob(image: Image.Image) -> tuple[list, bytes]:
    return [image.mode, *image.size], image.tobytes()


def image_from_blob(spec, data: bytes) -> Image.Image:
    mode, width, height = spec
    return Image.frombytes(mode, (width, height), data)


def _with_profile(blobs: dict, name: str, image: Image.Image) -> dict:
    """`blobs` and, as `name`.icc, the image's colour profile: its pixels alone leave it behind, and every
    answer made from a template carries the template's (`canvas.paste_unmasked`)."""
    profile = image.info.get("icc_profile")
    return {**blobs, f"{name}.icc": profile} if profile else blobs


def finished_image(header: dict, blobs: dict) -> Image.Image:
    """The image of a helper's "finished" answer (`handle`)."""
    return _profiled(image_from_blob(header["image"], blobs["image"]), blobs, "image")


def _profiled(image: Image.Image, blobs: dict, name: str) -> Image.Image:
    """`image` with the colour profile `_with_profile` sent beside it, if any."""
    if blobs.get(f"{name}.icc"):
        image.info["icc_profile"] = blobs[f"{name}.icc"]
    return image


def template_message(template: Template) -> tuple[dict, dict, dict]:
    canvas = template.canvas
    header = {"template_id": template.template_id, "prompt": template.prompt, "steps": template.steps,
              "seed": template.seed, "guidance": template.guidance, "num_text_tokens": template.num_text_tokens,
              "canvas": [*canvas.size, *canvas.padded, canvas.stride], "recorded_mode": template.recorded_mode,
              "latent_shape": list(template.latent_shape), "negative_prompt": template.negative_prompt}
    image_spec, image = _image_blob(template.source)
    mask_spec, mask = _image_blob(template.recorded_mask)
    header.update(image=image_spec, recorded_mask=mask_spec)
    # The noise is not sent: it is drawn from the seed where it is needed.
    return header, {}, _with_profile({"template.image": image, "template.recorded_mask": mask}, "template.image",
                                     template.source)


def template_from_message(header: dict, tensors: dict, blobs: dict) -> Template:
    t = header["template"]
    width, height, padded_width, padded_height, stride = t["canvas"]
    source = _profiled(image_from_blob(t["image"], blobs["template.image"]), blobs, "template.image")
    return Template(template_id=t["template_id"], source=source,
                    canvas=Canvas((width, height), (padded_width, padded_height), stride), prompt=t["prompt"],
                    steps=t["steps"], seed=t["seed"], guidance=t["guidance"], latent_shape=tuple(t["latent_shape"]),
                    num_text_tokens=t["num_text_tokens"],
                    recorded_mask=image_from_blob(t["recorded_mask"], blobs["template.recorded_mask"]),
                    recorded_mode=t["recorded_mode"], negative_prompt=t["negative_prompt"])


def prepare_message(job: int, request: EditRequest, template: Template, lora: LoraChoice = ()) -> list:
    header, tensors, blobs = template_message(template)
    mask_spec, mask = _image_blob(request.mask)  # checked: "L" at the template's size
    return wire.encode({"kind": "prepare", "job": job, "template": header, "prompt": request.prompt,
                        "negative_prompt": request.negative_prompt, "guidance": request.guidance, "seed": request.seed,
                        "strength": request.strength, "mask": mask_spec, "lora": [use.header() for use in lora]},
                       tensors, {**blobs, "mask": mask})


def recording_message(job: int, template: Template, records: bool, strength: float = 1.0) -> list:
    header, tensors, blobs = template_message(template)
    return wire.encode({"kind": "record", "job": job, "template": header, "records": records, "strength": strength},
                       tensors, blobs)


def finish_message(job: int, template: Template, mask: Image.Image, latents: torch.Tensor) -> list:
    header, tensors, blobs = template_message(template)
    mask_spec, mask_bytes = _image_blob(mask)
    return wire.encode({"kind": "finish", "job": job, "template": header, "mask": mask_spec},
                       {**tensors, "latents": latents}, {**blobs, "mask": mask_bytes})


def ready_message(job: int, ready: ReadyEdit) -> list:
    inputs = ready.inputs
    mask_spec, mask = _image_blob(inputs.mask)
    compute_spec, compute_mask = _image_blob(inputs.compute_mask)
    tensors = {f"prepared.{k}": v for k, v in ready.prepared.tensors().items()}
    tensors.update(masked_idx=inputs.masked_idx, latents0=inputs.latents)
    return wire.encode({"kind": "prepared", "job": job, "prepared": ready.prepared.header(), "mask": mask_spec,
                        "compute_mask": compute_spec, "records": inputs.records},
                       tensors, {"mask": mask, "compute_mask": compute_mask})


def ready_from_message(header: dict, tensors: dict, blobs: dict, template: Template,
                       device: torch.device | str = "cpu") -> ReadyEdit:
    prepared = Prepared.from_tensors(header["prepared"], {k.removeprefix("prepared."): v.to(device)
                                                          for k, v in tensors.items() if k.startswith("prepared.")})
    inputs = EditInputs(template, image_from_blob(header["mask"], blobs["mask"]),
                        image_from_blob(header["compute_mask"], blobs["compute_mask"]), tensors["masked_idx"],
                        tensors["latents0"], header["records"])
    return ReadyEdit(inputs, prepared)


def handle(editor: MaskAwareEditor, frames: list, text_encoder_loras: TextEncoderLoras | None = None) -> list:
    """A helper's answer to one message: the prepared edit, the finished image, or an error.
    `text_encoder_loras`: the LoRA folder's text-encoder parts (None: the worker serves no LoRA)."""
    header, tensors, blobs = wire.decode(frames)
    job = header["job"]
    try:
        template = template_from_message(header, tensors, blobs)
        with torch.inference_mode():
            if header["kind"] == "prepare":
                request = EditRequest(template.template_id, image_from_blob(header["mask"], blobs["mask"]), header["prompt"],
                                      header["seed"], strength=float(header.get("strength", 1.0)),
                                      negative_prompt=header["negative_prompt"], guidance=header["guidance"])
                lora = parse_lora(header.get("lora") or [])
                if lora and text_encoder_loras is None:
                    raise LoraError("this helper was started without the worker's LoRA folder")
                uses = text_encoder_loras.of(lora) if lora else ()
                return ready_message(job, preprocess(editor, request, template, uses))
            if header["kind"] == "record":
                return ready_message(job, prepare_recording(editor, template, header["records"],
                                                            float(header.get("strength", 1.0))))
            mask = image_from_blob(header["mask"], blobs["mask"])
            image = postprocess(editor, template, mask, tensors["latents"].to(editor.pipe.device))
    except Exception as exc:  # the worker answers the request with it; the helper keeps serving
        return wire.encode({"kind": "error", "job": job, "error": type(exc).__name__, "message": str(exc)})
    spec, data = _image_blob(image)
    return wire.encode({"kind": "finished", "job": job, "image": spec}, blobs=_with_profile({"image": data}, "image",
                                                                                          image))


# ---- the helper processes ----

MAX_SOCKET_DIR = 96  # leaves room for "/tasks-NN" within the 107 bytes of a Unix socket path


class HelperPool:
    """`count` helper processes doing pre/post-processing; `on_message(header, tensors, blobs)` is
    called on a receiver thread with every answer.

    Each helper has a task socket of its own, so the pool knows which jobs a helper holds. A helper
    that dies (killed, out of memory) is replaced, and the jobs it held are sent again to a live
    helper (a job that has outlived `MAX_JOB_SENDS` helpers is answered with an error instead: it may
    be what kills them). A helper says it is alive every `silence_s / 4` seconds from a thread of its own,
    so one silent for `silence_s` (stopped, frozen by its host, or stuck holding the GIL) is killed, and so
    replaced likewise; a helper whose main thread alone hangs with the GIL released keeps talking and is
    not caught (an edit it holds ends at its request's timeout). Helpers die with the worker
    (`process_tree.die_with_parent`)."""

    MAX_JOB_SENDS = 3

    def __init__(self, model: str, device: str, dtype: torch.dtype, dilation: int, count: int,
                 on_message: Callable[[dict, dict, dict], None], start_timeout_s: float = 600.0,
                 build_in_memory: bool = False, threads: int = 0, run_dir: str | None = None,
                 poll_s: float = 0.2, scheduler: str | None = None, scheduler_description: str | None = None,
                 silence_s: float = 30.0, lora_dir: str | None = None):
        """`build_in_memory`: the helpers build the built-in `model` on their device as the parent did
        (`retouch.models.loading.build_loaded`) instead of loading its export: the same seeds, the
        same weights. `threads`: torch CPU threads of each helper (0: torch's default). `run_dir`:
        where their sockets' folder goes (default: the system's temporary folder). `scheduler`: the
        `--scheduler` the parent's model was loaded with; `scheduler_description`: the scheduler it runs
        (`samplers.describe`), which the helpers then run too, however the parent came by it (the
        helpers set up each request's schedule). `silence_s`: how long a helper may say nothing before it is
        killed and replaced (it says it is alive four times as often). `lora_dir`: the worker's LoRA folder,
        whose files' text-encoder parts the helpers apply as they encode prompts."""
        if count < 1:
            raise ValueError(f"the disaggregated mode needs at least one helper process, got {count}")
        if run_dir is None:  # a worker started on its own: one killed outright left its folder behind
            remove_stale_run_dirs(prefix=HELPERS_DIR_PREFIX)
        self._dir = tempfile.TemporaryDirectory(prefix=f"{HELPERS_DIR_PREFIX}{os.getpid()}-", dir=run_dir)
        if len(self._dir.name) > MAX_SOCKET_DIR:  # a Unix socket's path has 108 bytes at most
            self._dir.cleanup()
            raise RuntimeError(f"the helpers' socket folder {self._dir.name} is too long for a Unix socket path; "
                               "point TMPDIR (or the worker's --run-dir) at a shorter folder")
        self.context = zmq.Context()
        self.results = self.context.socket(zmq.PULL)
        self._results_address = f"ipc://{self._dir.name}/results"
        self.results.bind(self._results_address)
        self.tasks = []
        for index in range(count):
            socket = self.context.socket(zmq.PUSH)
            socket.bind(f"ipc://{self._dir.name}/tasks-{index}")
            self.tasks.append(socket)
        # Cancellations, by topic (the helper's index): a helper skips a job cancelled before it starts it.
        self.control = self.context.socket(zmq.PUB)
        self._control_address = f"ipc://{self._dir.name}/control"
        self.control.bind(self._control_address)
        self._command = [sys.executable, "-m", "retouch.engine.processing", "--model", model, "--device", device,
                         "--dtype", str(dtype).removeprefix("torch."), "--dilation", str(dilation),
                         "--results", self._results_address, "--control", self._control_address,
                         "--threads", str(threads), "--alive-every", f"{silence_s / 4:g}"]
        self._command += ["--build-in-memory"] if build_in_memory else []
        self._command += ["--scheduler", scheduler] if scheduler is not None else []
        self._command += ["--scheduler-description", scheduler_description] if scheduler_description else []
        self._command += ["--lora-dir", lora_dir] if lora_dir else []  # as the worker: "" is no folder
        self._env = child_env()
        self._lock = threading.Lock()  # the task sockets and the books below
        self._outstanding: dict[int, tuple[int, list, int]] = {}  # job -> (helper, frames, times sent)
        self._alive = [False] * count  # said hello and not dead since
        self._heard = [0.0] * count  # when each last said anything (time.monotonic)
        self._silence_s = silence_s
        self._judged_at = time.monotonic()  # the last look for silent helpers
        self._backlog: list[int] = []  # jobs waiting for a live helper
        self.restarts = 0
        self.skipped = 0  # cancelled jobs the helpers dropped unrun
        self.processes: list[subprocess.Popen] = []
        self.on_message = on_message
        self._poll_s = poll_s
        self._closing, self._spawned, self._running = threading.Event(), threading.Event(), threading.Event()
        # Helpers are started from the watcher thread only: their parent-death signal follows the
        # thread that forked them, and this one lives as long as the pool.
        self._watcher = threading.Thread(target=self._watch, args=(count,), name="retouch-helper-watch", daemon=True)
        self._watcher.start()
        self._spawned.wait()
        self._await_hellos(count, start_timeout_s)
        self._receiver = threading.Thread(target=self._receive, name="retouch-helper-results", daemon=True)
        self._receiver.start()
        self._running.set()

    def _spawn(self, index: int) -> subprocess.Popen:
        return subprocess.Popen(self._command + ["--tasks", f"ipc://{self._dir.name}/tasks-{index}",
                                                 "--index", str(index)], env=self._env)

    def _await_hellos(self, count: int, timeout_s: float) -> None:
        poller = zmq.Poller()
        poller.register(self.results, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        while not all(self._alive):
            if any(p.poll() is not None for p in self.processes):
                self.close()
                raise RuntimeError("a pre/post-processing helper process exited while loading the model")
            if poller.poll(1000):
                header, _, _ = wire.decode(self.results.recv_multipart())
                if header.get("kind") == "hello":
                    self._alive[int(header["index"])] = True
                    self._heard[int(header["index"])] = time.monotonic()
            elif time.monotonic() > deadline:
                self.close()
                raise TimeoutError(f"helper processes not ready after {timeout_s:.0f} s")

    def send(self, job: int, frames: list) -> None:
        """Send job `job` to the live helper holding the fewest jobs."""
        with self._lock:
            self._outstanding[job] = (-1, frames, 0)
            self._dispatch(job)

    def cancel(self, job: int) -> None:
        """Forget `job`: it is not sent again, and its helper skips it unless it has started it (its answer, if
        any, is dropped)."""
        with self._lock:
            entry = self._outstanding.pop(job, None)
            if entry is None:
                return
            if job in self._backlog:
                self._backlog.remove(job)
            elif entry[0] >= 0 and not self._closing.is_set():
                self.control.send_multipart([cancel_topic(entry[0]), *wire.encode({"kind": "cancel", "job": job})])

    def _dispatch(self, job: int) -> None:
        """With the lock held: send `job` to a live helper, or keep it until one is."""
        held = [0] * len(self._alive)
        for helper, _, _ in self._outstanding.values():
            if helper >= 0:
                held[helper] += 1
        _, frames, sent = self._outstanding[job]
        for helper in sorted((i for i, alive in enumerate(self._alive) if alive), key=held.__getitem__):
            try:  # never block: a helper that just died (or has not connected yet) has no pipe
                self.tasks[helper].send_multipart(frames, copy=False, flags=zmq.NOBLOCK)
            except zmq.Again:
                continue
            self._outstanding[job] = (helper, frames, sent + 1)
            return
        self._backlog.append(job)

    def _receive(self) -> None:
        while True:
            try:
                frames = self.results.recv_multipart(copy=False)
            except zmq.ZMQError:  # closed
                return
            header, tensors, blobs = wire.decode([frame.buffer for frame in frames])
            kind = header.get("kind")
            if kind == "stop":
                return
            if kind == "alive":
                with self._lock:
                    self._heard[int(header["index"])] = time.monotonic()
                continue
            if kind == "skipped":
                with self._lock:
                    self.skipped += 1
                continue
            if kind == "hello":  # a replacement is ready: it takes what waited for it
                with self._lock:
                    self._alive[int(header["index"])] = True
                    self._heard[int(header["index"])] = time.monotonic()
                    backlog, self._backlog = self._backlog, []
                    for job in backlog:
                        self._dispatch(job)
                continue
            with self._lock:
                if self._outstanding.pop(header.get("job"), None) is None:
                    continue  # answered already (sent again after its helper died, answered twice)
            self.on_message(header, tensors, blobs)

    def _watch(self, count: int) -> None:
        self.processes = [self._spawn(index) for index in range(count)]
        self._spawned.set()
        while not (self._running.is_set() or self._closing.is_set()):
            self._closing.wait(self._poll_s)
        while not self._closing.wait(self._poll_s):
            with self._lock:
                backlog, self._backlog = self._backlog, []
                for job in backlog:
                    self._dispatch(job)
            self._kill_the_silent()
            for index, process in enumerate(self.processes):
                if process.poll() is None or self._closing.is_set():
                    continue
                logger.warning(f"helper {index} exited with {process.returncode}; starting a replacement")
                failed = []
                with self._lock:
                    self._alive[index] = False
                    self.restarts += 1
                    self.processes[index] = self._spawn(index)
                    for job, (helper, frames, sent) in list(self._outstanding.items()):
                        if helper != index:
                            continue
                        if sent >= self.MAX_JOB_SENDS:
                            del self._outstanding[job]
                            failed.append(job)
                        else:
                            self._outstanding[job] = (-1, frames, sent)
                            self._dispatch(job)
                for job in failed:
                    self.on_message({"kind": "error", "job": job, "error": "HelperError",
                                     "message": f"{self.MAX_JOB_SENDS} helper processes died running it"}, {}, {})

    def _kill_the_silent(self) -> None:
        """Kill each live helper that has said nothing for `silence_s`: the loop below then replaces it. Not
        after a pause of this process itself (SIGSTOP, a frozen VM, swapping: the watcher did not look for half
        of `silence_s`): what the helpers said meanwhile is still unread, so each gets a fresh bound."""
        now = time.monotonic()
        with self._lock:
            paused, self._judged_at = now - self._judged_at > self._silence_s / 2, now
            if paused:
                self._heard = [max(heard, now) for heard in self._heard]
                return
            silent = [index for index, alive in enumerate(self._alive)
                      if alive and now - self._heard[index] > self._silence_s]
        for index in silent:
            process = self.processes[index]
            if process.poll() is None:
                logger.warning(f"helper {index} has said nothing for {now - self._heard[index]:.0f} s (stopped or "
                               "hung); killing it")
                process.kill()
                process.wait()

    def close(self) -> None:
        self._closing.set()
        if getattr(self, "_watcher", None) is not None:
            self._watcher.join(timeout=10)
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if getattr(self, "_receiver", None) is not None:
            with self.context.socket(zmq.PUSH) as wake:  # unblocks the receiver
                wake.connect(self._results_address)
                wake.send_multipart(wire.encode({"kind": "stop"}))
            self._receiver.join(timeout=10)
        for socket in self.tasks:
            socket.close(linger=0)
        with self._lock:  # a future's callback may be cancelling a job on another thread
            self.control.close(linger=0)
        self.results.close(linger=0)
        self.context.term()
        self._dir.cleanup()


def cancel_topic(helper: int) -> bytes:
    """The PUB/SUB topic of one helper's cancels; delimited, since subscriptions match by prefix (1 and 10)."""
    return f"{helper}:".encode()


class CancelledJobs:
    """Job ids cancelled before this helper took them up; the oldest are forgotten past `limit` (a cancel
    that arrives after its job ran is never taken)."""

    def __init__(self, limit: int = 4096):
        self.limit = limit
        self._ids: dict[int, None] = {}

    def add(self, job: int) -> None:
        self._ids[job] = None
        if len(self._ids) > self.limit:
            del self._ids[next(iter(self._ids))]

    def take(self, job) -> bool:
        """Whether `job` was cancelled (then forgotten: ids are not reused)."""
        if job not in self._ids:
            return False
        del self._ids[job]
        return True


def _say_alive(context: zmq.Context, address: str, index: int, every_s: float) -> None:
    """Tell the pool this helper is alive, every `every_s`, on a socket of this thread's own (a socket is
    not thread-safe): the pool kills a helper that falls silent (`HelperPool`)."""
    with context.socket(zmq.PUSH) as socket:
        socket.connect(address)
        message = wire.encode({"kind": "alive", "index": index})
        while True:
            socket.send_multipart(message)
            time.sleep(every_s)


def main(argv: list[str] | None = None) -> None:
    from retouch.cache import InMemoryActivationCache
    from retouch.models import load_pipeline
    from retouch.models.loading import build_loaded
    from retouch.models.samplers import from_description

    parser = argparse.ArgumentParser(prog="python -m retouch.engine.processing")
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--dilation", type=int, default=0)
    parser.add_argument("--tasks", required=True)
    parser.add_argument("--results", required=True)
    parser.add_argument("--control", default=None, help="the pool's cancellations (PUB, topic: --index)")
    parser.add_argument("--build-in-memory", action="store_true", help="build the built-in model, do not load it")
    parser.add_argument("--scheduler", default=None, help="the --scheduler the worker's model was loaded with")
    parser.add_argument("--scheduler-description", default=None, help="the scheduler the worker's model runs "
                        "(retouch.models.samplers.describe)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--index", type=int, default=0, help="which of the pool's helpers this is")
    parser.add_argument("--alive-every", type=float, default=7.5, help="seconds between its 'alive' messages")
    parser.add_argument("--lora-dir", default=None, help="the worker's LoRA folder (text-encoder parts)")
    args = parser.parse_args(argv)
    die_with_parent()  # a helper without its worker is ~700 MB of nothing
    cap_log_messages()  # the text encoders log the part of a long prompt they cut
    # Ctrl-C reaches the whole process group; the parent drains and stops this process itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if args.threads:
        # On a CPU-only host the helpers share its cores with the step loop: fewer threads trade their
        # own latency (VAE, text encoders) for the loop's under load.
        torch.set_num_threads(args.threads)
    # A helper stops every pipeline run at its first denoiser call, so it never needs the denoiser's
    # weights: a loaded pipeline leaves them off the GPU, and a built one frees them, with the allocator's
    # cache (which would keep an 11.9 B Flux transformer's 22 GiB from the worker's process).
    dtype = getattr(torch, args.dtype)
    if args.build_in_memory:
        model = build_loaded(args.model, device=args.device, dtype=dtype, scheduler=args.scheduler)
    else:
        model = load_pipeline(args.model, device=args.device, dtype=dtype, scheduler=args.scheduler, denoiser=False)
    if args.scheduler_description is not None:
        model.pipe.scheduler = from_description(args.scheduler_description)
    editor = MaskAwareEditor(model, cache=InMemoryActivationCache(), dilation=args.dilation)
    editor.denoiser.to("meta")
    text_encoder_loras = TextEncoderLoras(args.lora_dir, model.pipe) if args.lora_dir else None
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    context = zmq.Context()
    tasks, results = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    tasks.connect(args.tasks)
    results.connect(args.results)
    control = None
    if args.control is not None:
        control = context.socket(zmq.SUB)
        control.setsockopt(zmq.SUBSCRIBE, cancel_topic(args.index))
        control.connect(args.control)
    cancelled = CancelledJobs()
    results.send_multipart(wire.encode({"kind": "hello", "pid": os.getpid(), "index": args.index}))
    threading.Thread(target=_say_alive, args=(context, args.results, args.index, args.alive_every),
                     name="retouch-helper-alive", daemon=True).start()
    while True:
        frames = tasks.recv_multipart(copy=False)
        while control is not None and control.poll(0):
            _, *message = control.recv_multipart()
            cancelled.add(int(wire.peek(message)["job"]))
        buffers = [frame.buffer for frame in frames]
        job = wire.peek(buffers).get("job")
        if cancelled.take(job):
            results.send_multipart(wire.encode({"kind": "skipped", "job": job}))
            continue
        results.send_multipart(handle(editor, buffers, text_encoder_loras), copy=False)


if __name__ == "__main__":
    main()
