"""The `retouch` command line. Bad input gets one line on stderr and exit status 2, never a traceback.

Heavy imports (torch, diffusers) happen inside the commands, so `retouch --help` and input errors
answer at once.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from retouch.config import (EditOptions, ProfileOptions, ServeOptions, WorkerOptions, add_arguments, from_arguments,
                            resolve_device)
from retouch.errors import EXIT_USAGE, ArgumentParser, InputError, RetouchError
from retouch.log_limits import cap_log_messages
from retouch.strength import check_strength

EXIT_INTERNAL = 1


def cmd_edit(args) -> int:
    from retouch.images import (alpha_output_note, check_output_path, load_image_with_alpha, load_mask,
                                lossy_output_note)

    opts = from_arguments(EditOptions, args)
    cap_log_messages()  # the text encoders log the part of a long prompt they cut, whole
    # Everything that can be checked without the model is checked before loading it.
    image, alpha = load_image_with_alpha(opts.image)
    mask = load_mask(opts.mask, image.size, alpha=opts.mask_alpha)
    check_output_path(opts.out)
    if opts.paste_back and (note := lossy_output_note(opts.out)) is not None:
        print(f"retouch: {note}", file=sys.stderr)
    if not opts.paste_back:
        alpha = None  # the raw pipeline output
    elif alpha is not None and (note := alpha_output_note(opts.out)) is not None:
        print(f"retouch: {note}", file=sys.stderr)
    # A transparent template's answer keeps its alpha outside the mask: a cut-out stays one.
    out = functools.partial(_save_answer, alpha=alpha, mask=mask, path=opts.out)
    check_strength(opts.strength, edit_steps(opts), "--strength")
    lora = opts.lora_choice()
    if lora:
        from retouch.lora.files import lora_path

        for use in lora:  # an unknown name is one line before the model loads
            lora_path(opts.lora_dir, use.name)
    device, dtype = resolve_device(opts.device, opts.dtype)

    from retouch.models import load_pipeline

    started = time.perf_counter()
    model = load_pipeline(opts.model, device=device, dtype=dtype, scheduler=opts.scheduler)
    loaded = time.perf_counter()
    from retouch.models.samplers import steps_error

    steps = edit_steps(opts)
    problem = steps_error(model.pipe.scheduler, steps)
    if problem is not None:
        raise InputError(f"--steps {steps}: {type(model.pipe.scheduler).__name__} cannot make that many: {problem}")
    if opts.negative_prompt is not None:  # said in the flags' words, before any run
        from retouch.editor import check_negative_prompt, default_guidance

        guidance = default_guidance(model.pipe) if opts.guidance is None else opts.guidance
        check_negative_prompt(opts.negative_prompt, model.family, guidance, ("--negative-prompt", "--guidance"))
    if lora:
        return _lora_edit(opts, model, image, mask, lora, loaded - started, out)
    if opts.mask_aware:
        return _mask_aware_edit(opts, model, image, mask, loaded - started, out)

    from retouch.baseline import run_baseline_edit
    from retouch.progress import pipeline_bar

    with pipeline_bar(model.pipe, "edit"):
        edited = run_baseline_edit(
            model.pipe, image, mask, opts.prompt, steps=steps, seed=opts.seed, guidance=opts.guidance,
            strength=opts.strength, call_defaults=model.call_defaults,
            paste_back=opts.paste_back, negative_prompt=opts.negative_prompt)
    finished = time.perf_counter()
    path = out(edited)
    print(f"wrote {path} ({edited.width}x{edited.height}) with {named(model)} on {model.pipe.device}: "
          f"load {loaded - started:.2f} s, edit {finished - loaded:.2f} s")
    return 0


def _save_answer(edited, alpha, mask, path):
    """Write the answer; a transparent template's gets its alpha back (`canvas.paste_alpha`)."""
    from retouch.canvas import paste_alpha
    from retouch.images import save_image

    return save_image(paste_alpha(edited, alpha, mask), path)


def named(model) -> str:
    """The model's name, and its sampler when --scheduler chose one (what the edit ran)."""
    if model.scheduler is None:
        return model.name
    from retouch.models.samplers import label

    return f"{model.name} ({label(model.pipe.scheduler)})"


def edit_steps(opts: EditOptions) -> int:
    """--steps, or the one default of every mode (the editor's and `retouch serve`'s): the baseline once
    took the pipeline's (50 for Flux), so it and a mask-aware edit of the same command ran different schedules."""
    from retouch.editor import DEFAULT_STEPS

    return opts.steps or DEFAULT_STEPS


def _mask_aware_edit(opts: EditOptions, model, image, mask, load_seconds: float, out) -> int:
    """Register the image as a template (full compute, recorded), then edit it with the cache."""
    from retouch.cache import CacheStore, StoreConfig
    from retouch.editor import MaskAwareEditor
    from retouch.progress import pipeline_bar

    if not opts.paste_back:
        raise RetouchError("--no-paste-back applies to the baseline edit; mask-aware edits keep unmasked pixels")
    editor = MaskAwareEditor(model, cache=CacheStore(StoreConfig(host_bytes=int(opts.cache_host_gib * 2**30))),
                             cache_mode=opts.cache_mode, dilation=opts.dilation, compile=opts.compile,
                             cuda_graphs=opts.cuda_graphs)
    started = time.perf_counter()
    with pipeline_bar(model.pipe, "register template"):
        template_id = editor.register_template(image, prompt=opts.prompt, steps=edit_steps(opts),
                                               seed=opts.seed, guidance=opts.guidance,
                                               negative_prompt=opts.negative_prompt)
    registered = time.perf_counter()
    with pipeline_bar(model.pipe, "edit"):
        edited = editor.edit(template_id, mask, opts.prompt, seed=opts.seed, strength=opts.strength,
                             negative_prompt=opts.negative_prompt)
    finished = time.perf_counter()
    path = out(edited)
    print(f"wrote {path} ({edited.width}x{edited.height}) with {named(model)}, mask-aware ({opts.cache_mode}-cache): "
          f"load {load_seconds:.2f} s, register template {template_id} {registered - started:.2f} s "
          f"(full compute), edit {finished - registered:.2f} s")
    return 0


def _lora_edit(opts: EditOptions, model, image, mask, lora, load_seconds: float, out) -> int:
    """An edit with LoRA adapters, through an in-process engine that loads them before the first step.
    Without --mask-aware a one-off edit, computed in full: the stock pipeline's result with the LoRA.
    With it, the image is recorded as a template by the base model, then edited computing masked tokens."""
    from retouch.editor import EditRequest, MaskAwareEditor
    from retouch.engine.api import Engine
    from retouch.engine.worker import EngineConfig, StepWatch
    from retouch.progress import advance, bar

    if opts.mask_aware:  # an adapter that cannot be applied is said before the recording, a generation, not after
        from retouch.lora.files import lora_path, read_lora

        for use in lora:
            read_lora(lora_path(opts.lora_dir, use.name), use.name, model)
    editor = MaskAwareEditor(model, cache_mode=opts.cache_mode, dilation=opts.dilation, compile=opts.compile,
                             cuda_graphs=opts.cuda_graphs)
    config = EngineConfig(mode="naive", lora_dir=str(opts.lora_dir), lora_latest_step=0.0)
    steps = edit_steps(opts)
    started = time.perf_counter()
    registered, template_note = started, ""
    with Engine(editor, config, opts.model) as engine:
        if opts.mask_aware:
            with bar(desc="register template", total=steps, unit="step") as progress:
                template_id = engine.register_template(image, prompt=opts.prompt, steps=steps, seed=opts.seed,
                                                       guidance=opts.guidance, on_step=advance(progress),
                                                       negative_prompt=opts.negative_prompt)
            registered = time.perf_counter()
            template_note = f", register template {template_id} {registered - started:.2f} s (full compute)"
        with bar(desc="edit", total=steps, unit="step") as progress:
            watch = StepWatch(advance(progress))
            if opts.mask_aware:
                future = engine.submit(EditRequest(template_id, mask, opts.prompt, opts.seed, strength=opts.strength,
                                                   negative_prompt=opts.negative_prompt), watch, lora=lora)
            else:
                future = engine.submit_image(image, mask, opts.prompt, seed=opts.seed, steps=steps,
                                             guidance=opts.guidance, watch=watch, lora=lora, strength=opts.strength,
                                             negative_prompt=opts.negative_prompt)
            result = future.result()
    finished = time.perf_counter()
    path = out(result.image)
    how = f"mask-aware ({opts.cache_mode}-cache)" if opts.mask_aware else "in full"
    names = ",".join(f"{use.name}:{use.scale:g}" for use in lora)
    print(f"wrote {path} ({result.image.width}x{result.image.height}) with {named(model)}, {how}, LoRA {names}: "
          f"load {load_seconds:.2f} s{template_note}, edit {finished - registered:.2f} s")
    return 0


def cmd_profile(args) -> int:
    import torch

    from retouch.profile import run_profile

    opts = from_arguments(ProfileOptions, args)
    device, dtype = resolve_device(opts.device, opts.dtype)
    model = run_profile(opts, torch.device(device), dtype, command="retouch profile " + " ".join(sys.argv[2:]),
                        progress=True)
    print(json.dumps({"out": str(opts.out), "model": model.model, "device": model.device, "r2": model.r2_summary(),
                      "load_gbps": round(1e-9 / model.load.coef[0], 3) if model.load.coef[0] > 0 else None}))
    return 0


def cmd_models(args) -> int:
    from retouch.models import export_pipeline, get_spec, list_models

    if args.models_command == "export":
        if not args.directory.strip():
            raise InputError("models export needs a folder to write (it wrote into the current one)")
        if get_spec(args.name).kind == "bench":  # minutes, and weights of the published model's size
            print(f"exporting {args.name}: a full-size spec with random weights, as large as the published model "
                  "(minutes, and tens of GB for Flux)", file=sys.stderr, flush=True)
        try:
            path = export_pipeline(args.name, args.directory)
        except OSError as exc:  # a folder that cannot be made or written: the user's to fix
            raise InputError(f"cannot write {args.directory}: {exc.strerror or exc}") from None
        print(f"exported {args.name} to {path}")
        return 0
    specs = list_models()
    if args.json:
        print(json.dumps([{"name": s.name, "kind": s.kind, "family": s.family, "pipeline": s.pipeline_class,
                           "resolution": s.resolution, "description": s.description} for s in specs], indent=2))
        return 0
    rows = [("NAME", "KIND", "PIPELINE", "SIZE", "DESCRIPTION")]
    rows += [(s.name, s.kind, s.pipeline_class, f"{s.resolution}px", s.description) for s in specs]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[4])
    return 0


def cmd_bench(args) -> int:
    import importlib

    # The benchmark parses its own options and prints its JSON.
    importlib.import_module(f"retouch.bench.{args.name}").main(args.options)
    return 0


def check_model(opts):
    """An unknown model or a scheduler that cannot drive it is one error here, not one in every worker;
    returns the scheduler the workers will run."""
    from retouch.models import get_spec
    from retouch.models.loading import scheduler_for

    if not Path(opts.model).is_dir():
        get_spec(opts.model)
    return scheduler_for(opts.model, opts.scheduler)


def fit_steps(opts: ServeOptions, scheduler) -> None:
    """--max-steps lowered to the most steps `scheduler` makes (LCM: 50), so that a request for more is
    refused with a 400 naming steps rather than failing in a worker; --steps beyond it is an error."""
    from retouch.models.samplers import most_steps

    most = most_steps(scheduler, opts.max_steps)
    if most < opts.steps:
        raise RetouchError(f"--steps {opts.steps}: {type(scheduler).__name__} makes at most {most} steps")
    if most < opts.max_steps:
        print(f"retouch: --max-steps lowered to {most}: {type(scheduler).__name__} makes at most {most} steps",
              file=sys.stderr)
        opts.max_steps = most


def cmd_serve(args) -> int:
    opts = from_arguments(ServeOptions, args)

    fit_steps(opts, check_model(opts))
    from retouch.log_limits import setup_logging
    from retouch.server import Server

    setup_logging(opts.log_level)
    # SIGTERM while the workers load stops as Ctrl-C does: what was started is stopped, its folder removed
    # (nothing is accepted yet, so there is nothing to drain); serve_forever's handlers drain from then on.
    signal.signal(signal.SIGTERM, _stop_starting)
    Server(opts).start().serve_forever()
    return 0


def _stop_starting(signum, frame) -> None:
    # once: a process manager's repeat must not cut short the stopping of what was started
    signal.signal(signal.SIGTERM, lambda *_: os.write(2, b"retouch: still stopping\n"))
    raise KeyboardInterrupt


def cmd_worker(args) -> int:
    opts = from_arguments(WorkerOptions, args)

    check_model(opts)
    for path in (opts.curve_secret, opts.curve_server):  # a missing key file is one line, before loading
        if path is not None and not Path(path).is_file():
            raise RetouchError(f"key file {path} not found")
    from retouch.engine.node import run_worker

    run_worker(opts)
    return 0


def cmd_keys(args) -> int:
    from retouch.engine.curve import generate

    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise InputError(f"cannot write keys into {args.out}: it is not a folder")
    try:
        public, secret = generate(args.name, args.out)
    except OSError as exc:
        raise InputError(f"cannot write keys into {args.out}: {exc.strerror or exc}") from None
    print(json.dumps({"public": str(public), "secret": str(secret)}))
    return 0


def cmd_simulate(args) -> int:
    from retouch.engine import simulate

    simulate.main(args.options)  # parses its own options, prints its JSON
    return 0


def cmd_doctor(args) -> int:
    from retouch.doctor import report

    print(json.dumps(report(), indent=2))
    return 0


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="retouch", description="Generative image editing with diffusion models.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    edit = commands.add_parser("edit", help="repaint the masked region of an image (baseline diffusers pipeline)")
    add_arguments(edit, EditOptions)
    edit.set_defaults(handler=cmd_edit)

    models = commands.add_parser("models", help="list built-in models, or export one as a pipeline folder")
    models.add_argument("--json", action="store_true", help="print the list as JSON")
    models_commands = models.add_subparsers(dest="models_command", metavar="SUBCOMMAND")
    export = models_commands.add_parser("export", help="write a built-in model with save_pretrained")
    export.add_argument("name", help="built-in model name")
    export.add_argument("directory", help="new (or empty) folder to write")
    models.set_defaults(handler=cmd_models)

    profile = commands.add_parser("profile",
                                  help="time a model's blocks and host->device loads; fit cost models (JSON)")
    add_arguments(profile, ProfileOptions)
    profile.set_defaults(handler=cmd_profile)

    from retouch.bench import BENCHMARKS

    bench = commands.add_parser("bench", help="run a benchmark; prints one JSON object (see `retouch bench NAME -h`)")
    bench.add_argument("name", choices=BENCHMARKS, help="which benchmark")
    bench.add_argument("options", nargs=argparse.REMAINDER, help="the benchmark's own options")
    bench.set_defaults(handler=cmd_bench)

    serve = commands.add_parser("serve", help="serve edits over HTTP: router, worker processes and frontend")
    add_arguments(serve, ServeOptions)
    serve.set_defaults(handler=cmd_serve)

    worker = commands.add_parser("worker", help="a worker process on this host that joins a router elsewhere "
                                 "(`retouch serve --worker-listen`)")
    add_arguments(worker, WorkerOptions)
    worker.set_defaults(handler=cmd_worker)

    keys = commands.add_parser("keys", help="CURVE key pairs that authenticate workers and the router")
    keys_commands = keys.add_subparsers(dest="keys_command", required=True, metavar="SUBCOMMAND")
    generate = keys_commands.add_parser("generate", help="write NAME.key (public) and NAME.key_secret into --out")
    generate.add_argument("name", help="whose keys: router, or a worker's name")
    generate.add_argument("--out", default=".", help="folder to write them to (default: here)")
    generate.set_defaults(handler=cmd_keys)

    simulate = commands.add_parser("simulate", help="simulate a cluster's routing policies; prints JSON "
                                   "(see `retouch simulate -h`)", add_help=False)
    simulate.add_argument("options", nargs=argparse.REMAINDER, help="the simulator's own options")
    simulate.set_defaults(handler=cmd_simulate)

    doctor = commands.add_parser("doctor", help="report versions, CUDA, Triton and native-extension status as JSON")
    doctor.set_defaults(handler=cmd_doctor)
    return parser


def main(argv: list[str] | None = None) -> int:
    # No hub, ever: models are built-in or local folders.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    if argv[:1] == ["simulate"]:  # all of its options are the simulator's (REMAINDER cannot start with a flag)
        args = argparse.Namespace(handler=cmd_simulate, options=argv[1:])
    else:
        args = parser.parse_args(argv)
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        # A plain SIGTERM ends the process where it stands: temporary folders (a benchmark's adapter file of
        # hundreds of MiB) and helpers' sockets stayed. As SystemExit the `finally`s and `with`s run; `serve`
        # and `worker` put their own handler (a drain) in its place.
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    return reported(lambda: args.handler(args))


def _exit_on_sigterm(signum, frame) -> None:
    sys.exit(128 + signal.SIGTERM)


def reported(run: Callable[[], int]) -> int:
    """`run()`'s exit status, its errors said in one line: a bad input's (exit 2), an interruption's (130),
    or anything else as an internal error (1; RETOUCH_DEBUG=1 raises it, with its traceback)."""
    try:
        return run()
    except RetouchError as exc:
        print(f"retouch: error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - the CLI's last line of defence against tracebacks
        if os.environ.get("RETOUCH_DEBUG"):
            raise
        print(f"retouch: internal error: {type(exc).__name__}: {_one_line(exc)} "
              "(set RETOUCH_DEBUG=1 for the traceback)", file=sys.stderr)
        return EXIT_INTERNAL


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


if __name__ == "__main__":
    sys.exit(main())
