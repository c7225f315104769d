"""Options of a user-facing command, as validated dataclasses. CLI flags are derived from the fields
(`add_arguments`), so every option is declared once, with its help text, here.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path

from retouch.engine.policies import POLICIES
from retouch.errors import InputError, RetouchError
from retouch.limits import MAX_STEPS
from retouch.paths import check_writable, check_writable_folder
from retouch.log_limits import LOG_LEVELS
from retouch.lora import LoraChoice, LoraError, parse_lora

DEVICES = ("auto", "cpu", "cuda")
MODEL_NAME = re.compile(r"[A-Za-z0-9._:/-]{1,128}")  # --served-model-name: what clients put in `model`
CORS_ORIGIN = re.compile(r"\*|https?://[A-Za-z0-9.-]+(:\d{1,5})?")  # --cors-origins: a browser's Origin header
DTYPES = ("auto", "float32", "bfloat16", "float16")
LORA_DIR_HELP = "folder of LoRA adapters requests may name: NAME.safetensors or NAME/pytorch_lora_weights.safetensors"
LORA_DEVICE_HELP = ("device memory of {whose} LoRA copies kept for later requests (MiB; default: --lora-cache-mb); "
                    "adapters a queued or running request needs stay beyond it")
CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "float8_e4m3fn")  # retouch.cache.layout.STORAGE_DTYPES
MAX_PROFILE_GRID = 512  # tokens a side: 8192 px on Flux
MAX_PROFILE_BATCH = 256
CACHE_HOST_HELP = ("pinned host memory of {whose} template cache (GiB): every template being recorded or edited "
                   "is held whole in it (a flux-size template at 1024 px, 28 steps, bf16, Y-cache: about 40 GB)")
CACHE_DISK_HELP = ("folder of {whose} disk tier: templates evicted from host memory are written there and read "
                   "back on their next edit, and found again after a restart (default: none; evicted templates "
                   "are recorded again)")
CACHE_DISK_GIB_HELP = "disk tier budget of {whose} template cache (GiB); least recently used files go first"
CACHE_DTYPE_HELP = ("how cached activations are stored: auto keeps the model's dtype (lossless); float8_e4m3fn "
                    "halves bf16")


def model_label(model: str) -> str:
    """How workers, the router and clients name a model: a built-in's name, a pipeline folder's name
    (each host may mount it elsewhere, and the server's path is not the clients' business)."""
    return Path(model).name or model


def comma_list(value: str | None) -> list[str]:
    """A comma-separated option's items, stripped, empty ones left out."""
    return [item.strip() for item in (value or "").split(",") if item.strip()]


SCHEDULER_HELP = ("the sampler every edit runs instead of the pipeline's own: a diffusers scheduler class or "
                  "euler, euler-a, heun, lms, dpm2, dpm2-a, dpm++2m, dpm++2m-karras, dpm++2m-sde, dpm++2m-sde-karras, "
                  "ddim, plms, unipc, lcm, flow-euler, flow-heun; settings after a colon: "
                  "dpm++2m:solver_order=3,timestep_spacing=trailing")


def option(default=dataclasses.MISSING, *, help: str, choices=None, flag: str | None = None):  # noqa: A002
    """A dataclass field that carries its CLI help (and choices, or a flag name other than --field-name)."""
    metadata = {"help": help, "choices": choices, "flag": flag}
    return field(default=default, metadata=metadata)


@dataclass(slots=True)
class EditOptions:
    """One baseline edit: the unmodified diffusers pipeline repaints the masked region of an image."""

    model: str = option(help="built-in model name (see `retouch models`) or a local diffusers pipeline folder")
    image: Path = option(help="template image (any format PIL reads)")
    mask: Path = option(help="mask of the same size; white = repaint")
    prompt: str = option(help="what to paint into the masked region")
    negative_prompt: str | None = option(None, help="what to steer the masked region away from (SD3, SDXL, SD2: "
                                         "models with classifier-free guidance; refused for Flux)")
    steps: int | None = option(None, help="denoising steps (default 28 in every mode, as `retouch serve`)")
    seed: int = option(0, help="random seed of the initial noise")
    guidance: float | None = option(None, help="guidance scale (default: the pipeline's)")
    strength: float = option(1.0, help="how much of the masked region is re-noised, in (0, 1]: below 1 the edit keeps "
                             "the structure under the mask and runs the last steps x strength of the schedule")
    out: Path = option(Path("edited.png"), help="output image; format from the suffix")
    mask_alpha: bool = option(False, help="read the mask's alpha channel, OpenAI style: alpha 0 = repaint")
    paste_back: bool = option(True, help="keep the template's own pixels outside the mask")
    mask_aware: bool = option(False, help="register the image as a template, then edit it computing only masked tokens")
    cache_mode: str = option("y", help="mask-aware cache: y (block outputs, Fig. 5) or kv (keys/values, Fig. 7)",
                             choices=("y", "kv"))
    dilation: int = option(0, help="mask-aware: also recompute tokens within this many tokens of the mask")
    cache_host_gib: float = option(4.0, help="mask-aware: host memory of the template cache (GiB); the template is "
                                   "held whole in it (a flux-size template at 1024 px, 28 steps: about 40 GB)")
    compile: bool = option(False, help="mask-aware: run the blocks through torch.compile (the first steps compile)")
    cuda_graphs: bool = option(False, help="mask-aware, CUDA: replay CUDA graphs of the compiled blocks (implies "
                               "--compile)")
    device: str = option("auto", help="where to run", choices=DEVICES)
    dtype: str = option("auto", help="weights dtype (auto: float32 on cpu, bfloat16 on cuda)", choices=DTYPES)
    scheduler: str | None = option(None, help=SCHEDULER_HELP)
    lora: str | None = option(None, help="LoRA adapters of --lora-dir to edit with: NAME[:SCALE][,NAME[:SCALE]] "
                              "(scale 1 by default)")
    lora_dir: Path | None = option(None, help=LORA_DIR_HELP)

    def __post_init__(self):
        if not self.prompt.strip():
            raise InputError("--prompt is empty; say what to paint into the masked region")
        if self.steps is not None and not 1 <= self.steps <= MAX_STEPS:
            raise InputError(f"--steps must be in [1, {MAX_STEPS}], got {self.steps}")
        if not 0.0 < self.strength <= 1.0:
            raise InputError(f"--strength must be in (0, 1], got {self.strength}")
        if self.dilation < 0:
            raise InputError(f"--dilation must be >= 0, got {self.dilation}")
        if (self.compile or self.cuda_graphs) and not self.mask_aware:
            raise InputError("--compile and --cuda-graphs apply to mask-aware edits (add --mask-aware)")
        if (self.dilation or self.cache_mode != "y" or self.cache_host_gib != 4.0) and not self.mask_aware:
            raise InputError("--dilation, --cache-mode and --cache-host-gib apply to mask-aware edits (add --mask-aware)")
        if not (math.isfinite(self.cache_host_gib) and self.cache_host_gib * 2**30 >= 1 << 20):
            raise InputError(f"--cache-host-gib must be a finite number of at least 1 MiB, got {self.cache_host_gib}")
        if self.cuda_graphs and self.device == "cpu":
            raise InputError("--cuda-graphs needs a CUDA device (--device cuda or auto)")
        if self.guidance is not None and not (math.isfinite(self.guidance) and self.guidance >= 0):
            raise InputError(f"--guidance must be a number >= 0, got {self.guidance}")
        if not 0 <= self.seed < 2**64:
            raise InputError(f"--seed must be in [0, 2**64), got {self.seed}")
        _check_lora_dir(self.lora_dir)
        if self.lora_choice():
            if self.lora_dir is None:
                raise InputError("--lora names adapters of --lora-dir; add --lora-dir")
            if not self.paste_back:
                raise InputError("--no-paste-back applies to the baseline edit without --lora")

    def lora_choice(self) -> LoraChoice:
        """--lora parsed (`retouch.lora.parse_lora`); () without it. A LoraError names the flag."""
        try:
            return parse_lora(self.lora)
        except LoraError as exc:
            raise LoraError(f"--lora: {exc}") from None


def resolve_device(device: str, dtype: str):
    """`--device` and `--dtype` as run: auto picks CUDA when there is one (bf16 there, fp32 on the
    CPU); a CUDA device (cuda, cuda:N) that is not here is an error. Returns (device, torch dtype)."""
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RetouchError(f"--device {device} but no CUDA device is available (see `retouch doctor`)")
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    return device, getattr(torch, dtype)


# Finite too: NaN compares false both ways (it passed `v <= 0` checks), and inf overflowed where a
# number becomes bytes, milliseconds or a timestamp.
_BOUNDS = {"> 0": lambda v: math.isfinite(v) and v > 0, ">= 1": lambda v: math.isfinite(v) and v >= 1,
           ">= 0": lambda v: math.isfinite(v) and v >= 0}
MIN_HEARTBEAT_S = 0.01  # a heartbeat loop faster than this spins a core while idle


def _check_lora_dir(lora_dir: Path | None) -> None:
    if lora_dir is not None and not Path(lora_dir).is_dir():
        raise InputError(f"--lora-dir {lora_dir} is not a folder")


def _check_webhook_options(options) -> None:
    from retouch.webhooks import allowed_origin

    origins = comma_list(options.webhook_origins)
    if not all(allowed_origin(origin) for origin in origins):
        raise InputError(f"--webhook-origins takes http(s)://host[:port] origins (nothing after them), "
                         f"comma-separated; got {options.webhook_origins!r}")
    if origins and options.webhook_secret_file is None:
        raise InputError("--webhook-origins needs --webhook-secret-file (receivers verify each webhook's signature; "
                         "make one with: python -c \"import base64,os; print('whsec_'+base64.b64encode(os.urandom(32))"
                         ".decode())\")")
    if options.webhook_secret_file is not None and not Path(options.webhook_secret_file).is_file():
        raise InputError(f"--webhook-secret-file {options.webhook_secret_file} not found")
    if options.webhook_secret_file is not None and not origins:
        raise InputError("--webhook-secret-file without --webhook-origins: no webhook would be sent")


def _check_lora_options(options) -> None:
    """--lora-dir, --lora-cache-mb and --lora-latest-step of a server or worker."""
    _check_lora_dir(options.lora_dir)
    for flag, mb in (("--lora-cache-mb", options.lora_cache_mb), ("--lora-device-mb", options.lora_device_mb)):
        if mb is not None and not (math.isfinite(mb) and int(mb * 2**20) >= 1):  # a budget of 0 bytes holds nothing
            raise InputError(f"{flag} must be a finite number of at least one byte (1e-6 MiB), got {mb:g}")
    if not 0.0 <= options.lora_latest_step <= 1.0:
        raise InputError(f"--lora-latest-step must be in [0, 1], got {options.lora_latest_step}")


def _check_cache_options(options) -> None:
    """--cache-host-gib, --cache-disk-dir and --cache-disk-gib of a server or worker."""
    for name in ("cache_host_gib", "cache_disk_gib"):
        if not (math.isfinite(getattr(options, name)) and getattr(options, name) > 0):
            raise InputError(f"--{name.replace('_', '-')} must be a finite number > 0, got {getattr(options, name)}")
    if options.cache_host_gib * 2**30 < 1 << 20:
        raise InputError(f"--cache-host-gib must hold at least 1 MiB, got {options.cache_host_gib:g}")
    if options.cache_disk_dir is not None:
        check_writable_folder(options.cache_disk_dir)


def _check_edit_slots(options) -> None:
    if options.edit_slots is None:
        return
    if not 0 <= options.edit_slots < options.max_batch:
        raise InputError(f"--edit-slots must be from 0 to --max-batch - 1 ({options.max_batch - 1}): registrations "
                         f"need a slot; got {options.edit_slots}")
    if options.mode == "static":
        raise InputError("--edit-slots has no effect in --mode static: no edit joins a running batch there")


def _require(options, names: tuple[str, ...], bound: str) -> None:
    """Each option in `names` must satisfy `bound` ("> 0", ">= 1" or ">= 0"), else an error naming its flag."""
    for name in names:
        value = getattr(options, name)
        if not _BOUNDS[bound](value):
            raise InputError(f"--{name.replace('_', '-')} must be a finite number {bound}, got {value}")


def add_arguments(parser: argparse.ArgumentParser, options_cls: type) -> None:
    """Add one CLI flag per dataclass field; fields without a default become required flags."""
    hints = typing.get_type_hints(options_cls)
    for f in dataclasses.fields(options_cls):
        flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
        required = f.default is dataclasses.MISSING
        kwargs = {"dest": f.name, "help": f.metadata["help"], "required": required}
        if not required:
            kwargs["default"] = f.default
        if hints[f.name] is bool:  # --flag / --no-flag, the default named as the flag that gives it
            if not required and "(default" not in kwargs["help"]:
                kwargs["help"] += f" (default: {flag if f.default else '--no-' + flag.removeprefix('--')})"
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
            continue
        if not required and f.default is not None and "(default" not in kwargs["help"]:
            kwargs["help"] += f" (default: {f.default})"
        kwargs["type"] = _scalar_type(hints[f.name])
        if f.metadata.get("choices"):
            kwargs["choices"] = f.metadata["choices"]
        parser.add_argument(flag, **kwargs)


def from_arguments(options_cls: type, args: argparse.Namespace):
    return options_cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(options_cls)})


def _scalar_type(hint):
    # `int | None` -> int: None only ever comes from the default.
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


PROFILE_MIN_POINTS = 5  # the cost features (4, costs.FEATURES) and an intercept


@dataclass(slots=True)
class ProfileOptions:
    """Fit the cost models of one model on one device."""

    model: str = option(help="built-in model name (see `retouch models`)")
    device: str = option("auto", help="where to time", choices=("auto", "cpu", "cuda"))
    dtype: str = option("auto", help="weights dtype (auto: float32 on cpu, bfloat16 on cuda)",
                        choices=("auto", "float32", "bfloat16", "float16"))
    out: Path = option(Path("cost_model.json"), help="where to write the cost models (JSON)")
    grids: str = option("8,16,24,32", help="image token grids to time (tokens per side), comma-separated")
    batch_sizes: str = option("1,2,4", help="batch sizes to time, comma-separated")
    mask_ratios: str = option("0.1,0.3,0.6,1.0", help="mask ratios to time, comma-separated")
    repeats: int = option(3, help="timed repeats per point (the fastest is kept)")
    load_mib: str = option("0.25,1,4,16", help="host->device copy sizes to time (MiB), comma-separated")

    def __post_init__(self):
        for name in ("grids", "batch_sizes", "mask_ratios", "load_mib"):
            flag = f"--{name.replace('_', '-')}"
            try:
                values = [float(v) for v in getattr(self, name).split(",")]
            except ValueError:
                raise InputError(f"{flag} must be comma-separated numbers") from None
            if not all(math.isfinite(v) and v > 0 for v in values):
                raise InputError(f"{flag} values must be finite and > 0")
            if name in ("grids", "batch_sizes") and not all(v == int(v) for v in values):
                raise InputError(f"{flag} values must be whole numbers")
        if max(self.values("mask_ratios")) > 1:
            raise InputError("--mask-ratios must lie in (0, 1]")
        for name, most in (("grids", MAX_PROFILE_GRID), ("batch_sizes", MAX_PROFILE_BATCH)):
            if max(self.values(name)) > most:  # a typo, not a profile: the first forward would exhaust memory
                raise InputError(f"--{name.replace('_', '-')} values must be at most {most}")
        check_writable(self.out)  # before the profile runs, not after it
        if self.repeats < 1:
            raise InputError(f"--repeats must be >= 1, got {self.repeats}")
        # Each block's full-compute fit sees one sample per (grid, batch size) point: a least-squares fit of
        # the cost features and an intercept is determined only with at least as many points as unknowns
        # (more to judge its R^2); the load fit needs two sizes.
        points = len(set(self.values("grids", int))) * len(set(self.values("batch_sizes", int)))
        if points < PROFILE_MIN_POINTS:
            raise InputError(f"--grids x --batch-sizes give {points} distinct points; the cost fit needs at "
                             f"least {PROFILE_MIN_POINTS} (for example --grids 8,16,24 --batch-sizes 1,2)")
        if len(set(self.values("load_mib"))) < 2:
            raise InputError("--load-mib needs at least two distinct sizes to fit a load time per byte")

    def values(self, name: str, kind=float) -> list:
        return [kind(float(v)) for v in getattr(self, name).split(",")]


@dataclass(slots=True)
class ServeOptions:
    """The HTTP server: router, workers (one process per device) and frontend on one host."""

    model: str = option(help="built-in model name (see `retouch models`) or a local diffusers pipeline folder")
    workers: int = option(1, help="worker processes on this host (one per GPU); 0: only workers that join with "
                          "`retouch worker --connect`")
    host: str = option("127.0.0.1", help="HTTP address to bind (loopback unless you mean otherwise)")
    port: int = option(8000, help="HTTP port (0: any free port, printed on start)")
    served_model_name: str | None = option(None, help="the names a request's `model` may give, comma-separated "
                                           "(default: the model's name, a pipeline folder's without its path); an "
                                           "edit naming another is refused (404 model_not_found); list OpenAI's "
                                           "(gpt-image-1) to serve clients that hard-code it")
    policy: str = option("mask-aware", help="how the router picks a worker",
                         choices=POLICIES)
    cost_model: Path | None = option(None, help="fitted cost models (`retouch profile`) for mask-aware routing")
    worker_listen: str = option("tcp://127.0.0.1:0", help="where workers connect: tcp://ADDR:PORT (an address other "
                                "hosts reach needs --curve-secret and --curve-allowed) or ipc://PATH")
    curve_secret: Path | None = option(None, help="the router's secret key file (`retouch keys generate router`): "
                                       "workers authenticate with CURVE and the link is encrypted")
    curve_allowed: Path | None = option(None, help="folder of the public keys (*.key) of workers allowed to join")
    device: str = option("auto", help="where workers run (cuda: worker i uses GPU i)", choices=DEVICES)
    dtype: str = option("auto", help="weights dtype (auto: float32 on cpu, bfloat16 on cuda)", choices=DTYPES)
    scheduler: str | None = option(None, help=SCHEDULER_HELP)
    mode: str = option("disagg", help="batching mode of each worker", choices=("static", "naive", "disagg"))
    max_batch: int = option(8, help="requests per denoising step per worker")
    edit_slots: int | None = option(None, help="batch slots registrations leave to edits, so that an edit "
                                    "arriving while templates are being registered joins at the next step, not "
                                    "after a generation (default: a quarter of --max-batch, rounded down)")
    helpers: int = option(1, help="pre/post-processing processes per worker (disagg mode)")
    worker_threads: int = option(0, help="torch CPU threads per worker (0: torch's default; several workers on the "
                                 "CPU: its cores shared among them)")
    helper_threads: int = option(0, help="torch CPU threads per helper process (0: torch's default, or 1 for several "
                                 "workers on the CPU; on a CPU-only host, 1 keeps them off the step loop's cores "
                                 "under load)")
    helper_silence_s: float = option(30.0, help="a helper process silent this long (stopped, frozen) is killed and "
                                     "replaced, and its edits sent to another")
    steps: int = option(28, help="denoising steps of templates registered without `steps`")
    max_steps: int = option(200, help="largest `steps` a request may ask for")
    max_upload_mb: float = option(32.0, help="largest request body (MiB)")
    max_pixels: int = option(4096 * 4096, help="largest image or mask (pixels of the canvas it is edited on, sides "
                             "padded to multiples of 16; checked before decoding)")
    max_work: int = option(4096 * 4096 * 28, help="most work one request may ask for, in pixel-steps (canvas width x "
                           "height x steps x n, of the steps it runs: fewer below strength 1); beyond it: 413")
    max_queue: int = option(256, help="edits accepted and not yet answered; beyond it: 429 with Retry-After "
                            "(a registration also counts the templates being recorded)")
    max_queue_per_tenant: int = option(0, help="of them, one API key's at most (429 beyond), so one client's "
                                       "burst does not refuse every other client (0: --max-queue)")
    log_level: str = option("info", help="the least severe log lines written (info: one per HTTP answer, and "
                            "the workers' one per edit)", choices=LOG_LEVELS)
    max_templates_per_tenant: int = option(1000, help="registered templates each API key may keep (the head holds "
                                           "their images in memory); beyond it: 409 template_limit")
    max_templates_mb: float = option(4096.0, help="memory the head holds the registered templates' images in, "
                                     "every API key's (MiB); beyond it: 507 template_storage_full")
    max_one_off_mb: float = option(1024.0, help="memory the head remembers one-off images in (edits of an image "
                                   "sent with them, MiB); beyond it the least recently edited go (their next edit "
                                   "records them again)")
    api_keys_file: Path | None = option(None, help="file of API keys, one per line: /v1 needs `Authorization: Bearer "
                                        "KEY`, and each key sees only its own templates (default: $RETOUCH_API_KEYS, "
                                        "comma-separated; neither: no keys)")
    cors_origins: str | None = option(None, help="web pages of these origins may call the API from a browser, "
                                      "comma-separated scheme://host[:port] (or *); default: none (same origin)")
    webhook_origins: str | None = option(None, help="asynchronous edits may name a webhook URL of these origins "
                                         "(comma-separated http(s)://host[:port]), POSTed when the edit ends; "
                                         "default: none (no webhooks: a URL any client picks would make the head "
                                         "call its own network)")
    webhook_secret_file: Path | None = option(None, help="file holding the webhooks' signing secret (Standard "
                                              "Webhooks: whsec_ + base64; receivers verify with it); needed with "
                                              "--webhook-origins")
    docs: bool = option(True, help="serve /docs and /openapi.json (behind the API key when keys are set)")
    playground: bool = option(True, help="serve the playground page at / (it holds no data; its requests carry "
                                         "the API key typed into it)")
    max_prompt_chars: int = option(4000, help="longest prompt (characters); beyond it: 422")
    header_timeout_s: float = option(10.0, help="a client must send its request headers within this many seconds")
    body_timeout_s: float = option(120.0, help="... and its body within this many seconds after them")
    max_connections: int = option(1024, help="open HTTP connections; beyond it new ones are closed at once")
    max_inflight_mb: float = option(1024.0, help="request bodies being received at once (MiB); beyond it: 503")
    drain_s: float = option(60.0, help="on SIGTERM or Ctrl-C, seconds to answer the edits accepted (the rest "
                            "are answered 503); keep it below the orchestrator's grace period (Kubernetes: 30 s "
                            "unless the pod sets terminationGracePeriodSeconds, as deploy/k8s does)")
    result_ttl_s: float = option(3600.0, help="answers of asynchronous edits (async=true) and of edits sent with an "
                                 "Idempotency-Key are kept this long (seconds) for GET /v1/edits/{id}/result and "
                                 "retries (on disk too with --cache-disk-dir, so that they outlive a restart)")
    result_store_mb: float = option(512.0, help="... and within this much memory in all (MiB; the oldest go first)")
    heartbeat_s: float = option(0.5, help="seconds between worker heartbeats")
    dead_after_s: float = option(5.0, help="a worker silent this long is removed and its requests re-routed")
    transfer_timeout_s: float = option(120.0, help="an edit or template sent to a worker that has not seen it yet is "
                                       "on its way (a large image over a slow link) this long at most; then, missing "
                                       "from its heartbeats for --dead-after-s, it is sent again")
    no_worker_s: float = option(30.0, help="with no worker connected this long, waiting edits are answered 503 "
                                "and new ones refused at once (inf: wait; for a single worker whose restart "
                                "reloads a large model)")
    restart: bool = option(True, help="start a replacement when a worker process exits")
    compile: bool = option(False, help="workers run the blocks through torch.compile (their first steps compile)")
    cuda_graphs: bool = option(False, help="workers replay CUDA graphs of the compiled blocks (CUDA only; implies "
                               "--compile)")
    slo_ms_per_megapixel: float = option(0.0, help="default SLO of an edit without slo_ms: this many ms per "
                                         "megapixel of its image (0: none)")
    slo_ms_min: float = option(1000.0, help="with --slo-ms-per-megapixel: the default SLO is never shorter (what "
                               "an edit costs whatever its size: the text encoder, the VAE, the queue)")
    slo_admission: str = option("accept", help="an edit predicted to miss its SLO: accept it anyway, or reject it "
                                "at once (429 slo_unattainable; predicted with the cost model)",
                                choices=("accept", "reject"))
    cache_host_gib: float = option(4.0, help=CACHE_HOST_HELP.format(whose="each worker's"))
    cache_disk_dir: Path | None = option(None, help=CACHE_DISK_HELP.format(whose="this host's workers'") +
                                         "; each worker keeps a subfolder of its own (w0, w1, ...), and the "
                                         "registered templates are kept in DIR/templates and the answers of "
                                         "asynchronous and keyed edits in DIR/edits: a restarted server serves "
                                         "them again")
    cache_disk_gib: float = option(64.0, help=CACHE_DISK_GIB_HELP.format(whose="each worker's"))
    cache_dtype: str = option("auto", help=CACHE_DTYPE_HELP, choices=CACHE_DTYPES)
    lora_dir: Path | None = option(None, help=LORA_DIR_HELP + " (given to this host's workers; an edit naming "
                                   "one it lacks is refused before it queues)")
    lora_cache_mb: float = option(2048.0, help="host memory of each worker's cache of loaded LoRAs (MiB)")
    lora_device_mb: float | None = option(None, help=LORA_DEVICE_HELP.format(whose="each worker's"))
    lora_latest_step: float = option(0.3, help="a LoRA loads while its request already denoises and applies from "
                                     "the step after, at the latest from this fraction of the request's steps "
                                     "(0: loaded before its first step)")
    lora_affinity: int = option(0, help="an edit with a LoRA goes to a worker holding its adapters (no file read) "
                                "while that worker has a free batch slot and at most this many requests in flight "
                                "more than the least loaded one (-1: off, the policy alone decides)")
    template_replicas: int = option(0, help="workers each registered template is recorded on (0: every worker); "
                                    "fewer cost less GPU time per registration and leave the workers' caches room "
                                    "for more templates, but send each template's edits to its replicas only, "
                                    "which a popular template would overload: see --template-replicas-grow")
    template_replicas_grow: int = option(1, help="with --template-replicas K: a template with more than this many "
                                         "of its own edits in flight per replica, whose replicas all have more than "
                                         "this many requests in flight beyond the least loaded other worker, is "
                                         "recorded there too, until no edit went there for 5 minutes (-1: K "
                                         "replicas only)")
    template_affinity: int = option(0, help="an edit goes to a worker holding its template's recording in host "
                                    "memory (no disk read, no recording again) while that worker has a free batch "
                                    "slot and at most this many requests in flight more than the least loaded one "
                                    "(-1: off)")

    def __post_init__(self):
        if self.workers < 0:
            raise InputError(f"--workers must be >= 0, got {self.workers}")
        if (self.curve_secret is None) != (self.curve_allowed is None):
            raise InputError("--curve-secret and --curve-allowed go together (the router's key, the workers' keys)")
        if self.api_keys_file is not None and not Path(self.api_keys_file).is_file():
            raise InputError(f"--api-keys-file {self.api_keys_file} not found")
        _check_webhook_options(self)
        _require(self, ("header_timeout_s", "body_timeout_s", "max_inflight_mb", "result_ttl_s", "result_store_mb",
                        "transfer_timeout_s", "helper_silence_s", "max_templates_mb", "max_one_off_mb"), "> 0")
        _require(self, ("drain_s",), ">= 0")
        _require(self, ("max_connections", "max_prompt_chars", "max_batch", "steps", "max_steps", "max_queue",
                        "max_pixels", "max_work", "max_templates_per_tenant"), ">= 1")
        _check_edit_slots(self)
        _require(self, ("worker_threads", "helper_threads", "slo_ms_per_megapixel", "slo_ms_min",
                        "max_queue_per_tenant"), ">= 0")
        if self.cuda_graphs and self.device == "cpu":
            raise InputError("--cuda-graphs needs a CUDA device (--device cuda or auto)")
        if self.helpers < 1 and self.mode == "disagg":
            raise InputError("--helpers must be >= 1 in disagg mode")
        if not 0 <= self.port < 65536:
            raise InputError(f"--port must be in [0, 65535], got {self.port}")
        _require(self, ("max_upload_mb",), "> 0")
        # Checked here, before any worker loads the model, as the HTTP limits would check them after.
        if self.max_inflight_mb < self.max_upload_mb:
            raise InputError(f"--max-inflight-mb ({self.max_inflight_mb:g}) must hold one upload "
                             f"(--max-upload-mb {self.max_upload_mb:g})")
        if self.max_steps > MAX_STEPS:
            raise InputError(f"--max-steps must be at most {MAX_STEPS}, got {self.max_steps}")
        if self.steps > self.max_steps:
            raise InputError(f"--steps ({self.steps}) must not exceed --max-steps ({self.max_steps}): an edit "
                             "that omits steps would be refused the steps its template was recorded with")
        _require(self, ("heartbeat_s", "dead_after_s"), "> 0")
        if self.heartbeat_s < MIN_HEARTBEAT_S:
            raise InputError(f"--heartbeat-s must be at least {MIN_HEARTBEAT_S:g} s, got {self.heartbeat_s:g}")
        address = ROUTER_ADDRESS.fullmatch(self.worker_listen)
        if address is None or (address["port"] is not None and not 0 <= int(address["port"]) < 65536):
            raise InputError(f"--worker-listen must be tcp://ADDRESS:PORT with PORT in [0, 65535] (0: any free "
                             f"one) or ipc://PATH, got {self.worker_listen!r}")
        if self.dead_after_s <= self.heartbeat_s:
            raise InputError("--dead-after-s must exceed --heartbeat-s")
        if not self.no_worker_s > 0:  # inf: edits wait for a worker however long none is connected
            raise InputError(f"--no-worker-s must be > 0 (inf: wait for a worker), got {self.no_worker_s}")
        if self.cost_model is not None and not Path(self.cost_model).is_file():
            raise InputError(f"--cost-model {self.cost_model} not found")
        if not all(CORS_ORIGIN.fullmatch(origin) for origin in comma_list(self.cors_origins)):
            raise InputError(f"--cors-origins takes scheme://host[:port] origins (or *), comma-separated; got "
                             f"{self.cors_origins!r}")
        if self.served_model_name is not None and not all(
                MODEL_NAME.fullmatch(name.strip()) for name in self.served_model_name.split(",")):
            raise InputError("--served-model-name takes names of 1-128 letters, digits, '.', '_', ':', '/' or '-', "
                             f"comma-separated; got {self.served_model_name!r}")
        _check_lora_options(self)
        _check_cache_options(self)
        _require(self, ("template_replicas",), ">= 0")
        for name in ("lora_affinity", "template_affinity", "template_replicas_grow"):
            if getattr(self, name) < -1:
                raise InputError(f"--{name.replace('_', '-')} must be >= -1 (-1: off), got {getattr(self, name)}")

    def model_names(self) -> tuple[str, ...]:
        """What a request's `model` may say (the first is what /v1/models lists first)."""
        if self.served_model_name is None:
            return (model_label(self.model) or "retouch",)
        return tuple(dict.fromkeys(name.strip() for name in self.served_model_name.split(",")))


WORKER_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")
ROUTER_ADDRESS = re.compile(r"tcp://(?P<host>[^:/\s]+|\[[0-9a-fA-F:.]+\]):(?P<port>\d{1,5})|ipc://\S+")


@dataclass(slots=True)
class WorkerOptions:
    """One worker process (one device): started by `retouch serve` on its host, or on its own with
    `retouch worker --connect` to join a router on another host."""

    model: str = option(help="built-in model name (see `retouch models`) or a local diffusers pipeline folder")
    connect: str = option(help="the router's address: tcp://HOST:PORT (`retouch serve --worker-listen`)")
    name: str | None = option(None, help="this worker's name in the router's metrics (default: HOST-PID)")
    device: str = option("auto", help="auto, cpu, cuda or cuda:N")
    dtype: str = option("auto", help="weights dtype (auto: float32 on cpu, bfloat16 on cuda)", choices=DTYPES)
    scheduler: str | None = option(None, help=SCHEDULER_HELP)
    mode: str = option("disagg", help="batching mode", choices=("static", "naive", "disagg"))
    max_batch: int = option(8, help="requests per denoising step")
    edit_slots: int | None = option(None, help="batch slots registrations leave to edits, so that an edit "
                                    "arriving while templates are being registered joins at the next step, not "
                                    "after a generation (default: a quarter of --max-batch, rounded down)")
    helpers: int = option(1, help="pre/post-processing processes (disagg mode)")
    helper_threads: int = option(0, help="torch CPU threads per helper process (0: torch's default)")
    helper_silence_s: float = option(30.0, help="a helper process silent this long (stopped, frozen) is killed and "
                                     "replaced, and its edits sent to another")
    threads: int = option(0, help="torch CPU threads of the step loop (0: torch's default)")
    compile: bool = option(False, help="run the blocks through torch.compile (compiled before joining)")
    cuda_graphs: bool = option(False, help="replay CUDA graphs of the compiled blocks (CUDA only)")
    curve_secret: Path | None = option(None, help="this worker's secret key file (`retouch keys generate`); needed "
                                       "with --curve-server to join a router that uses CURVE")
    curve_server: Path | None = option(None, help="the router's public key file (ROUTER.key)")
    health_port: int = option(0, help="serve /healthz, /readyz and /metrics on this port (0: off)")
    health_host: str = option("0.0.0.0", help="address of the health port")
    run_dir: Path | None = option(None, help="folder for the helpers' sockets (default: a new temporary folder)")
    supervised: bool = option(False, help="started by `retouch serve` on this host: exit when it does")
    log_level: str = option("info", help="the least severe log lines written (info: one per edit)",
                            choices=LOG_LEVELS)
    cache_host_gib: float = option(4.0, help=CACHE_HOST_HELP.format(whose="this worker's"))
    cache_disk_dir: Path | None = option(None, help=CACHE_DISK_HELP.format(whose="this worker's"))
    cache_disk_gib: float = option(64.0, help=CACHE_DISK_GIB_HELP.format(whose="this worker's"))
    cache_dtype: str = option("auto", help=CACHE_DTYPE_HELP, choices=CACHE_DTYPES)
    lora_dir: Path | None = option(None, help=LORA_DIR_HELP)
    lora_cache_mb: float = option(2048.0, help="host memory of this worker's cache of loaded LoRAs (MiB)")
    lora_device_mb: float | None = option(None, help=LORA_DEVICE_HELP.format(whose="this worker's"))
    lora_latest_step: float = option(0.3, help="a LoRA loads while its request already denoises and applies from "
                                     "the step after, at the latest from this fraction of the request's steps "
                                     "(0: loaded before its first step)")

    def __post_init__(self):
        if not WORKER_DEVICE.fullmatch(self.device):
            raise InputError(f"--device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        _require(self, ("max_batch",), ">= 1")
        _require(self, ("threads", "helper_threads"), ">= 0")
        _check_edit_slots(self)
        _require(self, ("helper_silence_s",), "> 0")
        if self.helpers < 1 and self.mode == "disagg":
            raise InputError("--helpers must be >= 1 in disagg mode")
        if not 0 <= self.health_port < 65536:
            raise InputError(f"--health-port must be in [0, 65535], got {self.health_port}")
        if (self.curve_secret is None) != (self.curve_server is None):
            raise InputError("--curve-secret and --curve-server go together (this worker's key, the router's key)")
        if self.cuda_graphs and self.device == "cpu":
            raise InputError("--cuda-graphs needs a CUDA device")
        if self.run_dir is not None:
            check_writable_folder(self.run_dir)
        address = ROUTER_ADDRESS.fullmatch(self.connect)
        if address is None or (address["port"] is not None and not 0 < int(address["port"]) < 65536):
            raise InputError(f"--connect must be tcp://HOST:PORT with PORT in [1, 65535] (or ipc://PATH), "
                             f"got {self.connect!r}")
        _check_lora_options(self)
        _check_cache_options(self)

    def cache_config(self):
        """The template cache these options ask for (`retouch.cache.StoreConfig`)."""
        from retouch.cache import StoreConfig

        return StoreConfig(host_bytes=int(self.cache_host_gib * 2**30), disk_dir=self.cache_disk_dir,
                           disk_bytes=int(self.cache_disk_gib * 2**30), dtype=self.cache_dtype)
