"""The deployment artifacts (Dockerfile, deploy/k8s) agree with each other and with the CLI.

No cluster and no Docker daemon: the manifests are parsed as YAML and the Dockerfile as text, and what
one side names (a Service port, a secret key, a probe port, a CLI flag) must exist on the other.
"""

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "deploy" / "k8s"
DOCKERFILE = REPO / "Dockerfile"

# The Secrets a deployment creates (deploy/README.md), by name, with the keys each holds. They are
# created with kubectl, never committed.
SECRET_KEYS = {
    "retouch-curve": {"router.key", "router.key_secret", "worker.key", "worker.key_secret"},
    "retouch-api-keys": {"keys"},
}
SECRET_FILE_FLAGS = ("--curve-secret", "--curve-server", "--api-keys-file")  # each names one file
SECRET_FOLDER_FLAGS = ("--curve-allowed",)  # each names a folder of public keys
HEAD, WORKER, SERVICE = "retouch-head", "retouch-worker", "retouch-head"
# Which flag names the port each role's HTTP server (probes, /metrics) listens on.
HTTP_PORT_FLAG = {HEAD: "--port", WORKER: "--health-port"}
SECRET_VOLUME_DEFAULT_MODE = 0o644  # Kubernetes' default for secret volume files


def manifest_files() -> list[Path]:
    return [path for path in sorted(K8S.glob("*.yaml")) if path.name != "kustomization.yaml"]


def manifests() -> list[dict]:
    documents = []
    for path in manifest_files():
        documents += [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    return documents


def kustomized(folder: Path) -> list[dict]:
    """What `kubectl apply -k folder` would apply (kubectl's built-in kustomize, offline)."""
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl (with its built-in kustomize) is not installed")
    built = subprocess.run(["kubectl", "kustomize", str(folder)], capture_output=True, text=True, timeout=60)
    assert built.returncode == 0, built.stderr
    return [doc for doc in yaml.safe_load_all(built.stdout) if doc is not None]


def find(kind: str, name: str) -> dict:
    (found,) = [doc for doc in manifests() if doc["kind"] == kind and doc["metadata"]["name"] == name]
    return found


def pod_spec(deployment: str) -> dict:
    return find("Deployment", deployment)["spec"]["template"]["spec"]


def container(deployment: str) -> dict:
    (only,) = pod_spec(deployment)["containers"]
    return only


def parse_args(args: list[str]) -> tuple[str, dict[str, str | None]]:
    """`[subcommand, --flag, value, --switch, --flag=value, ...]` -> (subcommand, {flag: value or None})."""
    command, *rest = args
    flags = {}
    i = 0
    while i < len(rest):
        token = rest[i]
        assert token.startswith("--"), f"positional argument {token!r} after {command}"
        if "=" in token:
            flag, value = token.split("=", 1)
            i += 1
        elif i + 1 < len(rest) and not rest[i + 1].startswith("--"):
            flag, value = token, rest[i + 1]
            i += 2
        else:
            flag, value = token, None
            i += 1
        assert flag not in flags, f"{flag} given twice"
        flags[flag] = value
    return command, flags


def env_value(deployment: str, name: str) -> str:
    (var,) = [v for v in container(deployment).get("env", []) if v["name"] == name]
    if "value" in var:
        return var["value"]
    ref = var["valueFrom"]["configMapKeyRef"]
    return find("ConfigMap", ref["name"])["data"][ref["key"]]


def flags_of(deployment: str) -> dict[str, str | None]:
    """The container's flags, with Kubernetes' $(VAR) expanded from its env."""
    _, flags = parse_args(container(deployment)["args"])

    def expand(value: str) -> str:
        return re.sub(r"\$\((\w+)\)", lambda match: env_value(deployment, match.group(1)), value)

    return {flag: None if value is None else expand(value) for flag, value in flags.items()}


def container_ports(deployment: str) -> dict[str, int]:
    return {port.get("name", str(port["containerPort"])): port["containerPort"]
            for port in container(deployment).get("ports", [])}


def resolve_port(deployment: str, port: int | str) -> int:
    """A probe's or Service's port (a number or a containerPort's name) -> a declared containerPort."""
    ports = container_ports(deployment)
    if isinstance(port, str) and not port.isdigit():
        assert port in ports, f"{deployment}: no containerPort named {port!r}"
        return ports[port]
    assert int(port) in ports.values(), f"{deployment}: port {port} is not a declared containerPort"
    return int(port)


def tcp_port(address: str) -> int:
    match = re.fullmatch(r"tcp://([^:/]+):(\d+)", address)
    assert match, f"not a tcp://host:port address: {address}"
    return int(match.group(2))


def mounted_secret_files(deployment: str) -> dict[str, tuple[str, str]]:
    """Every file the container sees from a secret volume: path -> (secret name, key)."""
    volumes = {volume["name"]: volume for volume in pod_spec(deployment).get("volumes", [])}
    files = {}
    for mount in container(deployment).get("volumeMounts", []):
        secret = volumes[mount["name"]].get("secret")
        if secret is None:
            continue
        name = secret["secretName"]
        items = secret.get("items") or [{"key": key, "path": key} for key in sorted(SECRET_KEYS.get(name, ()))]
        for item in items:
            if "subPath" in mount:
                if mount["subPath"] == item["path"]:
                    files[mount["mountPath"]] = (name, item["key"])
            else:
                files[f"{mount['mountPath'].rstrip('/')}/{item['path']}"] = (name, item["key"])
    return files


def secret_key_behind(deployment: str, path: str) -> str:
    files = mounted_secret_files(deployment)
    assert path in files, f"{deployment}: {path} is not a file of any mounted secret ({sorted(files)})"
    return files[path][1]


def public_keys_in(deployment: str, folder: str) -> set[str]:
    prefix = folder.rstrip("/") + "/"
    return {key for path, (_, key) in mounted_secret_files(deployment).items() if path.startswith(prefix)}


def cli_help(*command: str) -> str:
    result = subprocess.run([sys.executable, "-m", "retouch.cli", *command, "--help"], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, f"retouch {' '.join(command)} --help failed: {result.stderr[-2000:]}"
    return result.stdout


def test_manifests_hold_the_expected_objects_and_no_secret_values():
    documents = manifests()
    for doc in documents:
        assert {"apiVersion", "kind", "metadata"} <= doc.keys() and doc["metadata"].get("name"), doc
    objects = {(doc["kind"], doc["metadata"]["name"]) for doc in documents}
    assert {("Deployment", HEAD), ("Deployment", WORKER), ("Service", SERVICE)} <= objects
    assert len(objects) == len(documents), "two objects of the same kind and name"
    assert not [name for kind, name in objects if kind == "Secret"], "keys are created with kubectl, never committed"


@pytest.mark.parametrize("deployment", [HEAD, WORKER])
def test_deployment_selects_its_own_pods(deployment):
    spec = find("Deployment", deployment)["spec"]
    selector = spec["selector"]["matchLabels"]
    assert selector and selector.items() <= spec["template"]["metadata"]["labels"].items()
    other = WORKER if deployment == HEAD else HEAD
    assert not selector.items() <= find("Deployment", other)["spec"]["template"]["metadata"]["labels"].items()


def test_one_head_at_a_time():
    # The router holds the worker registry: a second head during a rolling update would split the workers.
    spec = find("Deployment", HEAD)["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"]["type"] == "Recreate"


def test_service_exposes_the_heads_http_and_router_ports():
    service = find("Service", SERVICE)["spec"]
    head_labels = find("Deployment", HEAD)["spec"]["template"]["metadata"]["labels"]
    worker_labels = find("Deployment", WORKER)["spec"]["template"]["metadata"]["labels"]
    assert service["selector"].items() <= head_labels.items()
    assert not service["selector"].items() <= worker_labels.items()
    flags = flags_of(HEAD)
    targets = {port["port"]: resolve_port(HEAD, port.get("targetPort", port["port"])) for port in service["ports"]}
    assert targets.get(8000) == int(flags["--port"]) == 8000
    assert targets.get(5555) == tcp_port(flags["--worker-listen"]) == 5555
    # The head turns ready only once a worker has joined, and workers join through this Service.
    assert service.get("publishNotReadyAddresses") is True


def test_head_listens_on_all_interfaces():
    flags = flags_of(HEAD)
    assert flags["--host"] == "0.0.0.0"
    assert flags["--worker-listen"].startswith("tcp://0.0.0.0:")
    assert flags["--workers"] == "0"


def test_worker_connects_to_the_services_router_port():
    address = flags_of(WORKER)["--connect"]
    match = re.fullmatch(r"tcp://([^:/]+):(\d+)", address)
    assert match, address
    host, port = match.group(1), int(match.group(2))
    assert host.split(".")[0] == SERVICE
    service_ports = {p["port"]: p.get("targetPort", p["port"]) for p in find("Service", SERVICE)["spec"]["ports"]}
    assert port in service_ports, f"{SERVICE} has no port {port}"
    assert resolve_port(HEAD, service_ports[port]) == tcp_port(flags_of(HEAD)["--worker-listen"])


@pytest.mark.parametrize("deployment", [HEAD, WORKER])
def test_probes_reach_the_http_server(deployment):
    spec = container(deployment)
    http_port = int(flags_of(deployment)[HTTP_PORT_FLAG[deployment]])
    assert http_port in container_ports(deployment).values()
    expected = {"livenessProbe": "/healthz", "readinessProbe": "/readyz", "startupProbe": "/healthz"}
    for probe, path in expected.items():
        if probe == "startupProbe" and probe not in spec:
            continue
        assert spec[probe]["httpGet"]["path"] == path, probe
        assert resolve_port(deployment, spec[probe]["httpGet"]["port"]) == http_port, probe


def test_the_head_is_given_time_to_drain():
    # SIGTERM drains for --drain-s; a kill before it ends resets the connections of edits still running.
    # After the drain come the workers' stop and the last answers and webhooks (seconds).
    from retouch.config import ServeOptions

    drain = flags_of(HEAD).get("--drain-s")
    drain_s = float(drain) if drain is not None else ServeOptions.__dataclass_fields__["drain_s"].default
    assert pod_spec(HEAD).get("terminationGracePeriodSeconds", 30) >= drain_s + 15


def test_what_the_head_holds_in_memory_fits_its_memory_limit():
    # Templates, one-off images, kept answers and bodies being received are each bounded by a flag: raising
    # one, or lowering the limit, must keep their sum inside it (1 GiB more is the process itself), or the
    # head is OOM-killed with every edit in flight.
    from retouch.config import ServeOptions

    flags, fields = flags_of(HEAD), ServeOptions.__dataclass_fields__
    held_mb = sum(float(flags.get(flag) or fields[name].default) for flag, name in (
        ("--max-templates-mb", "max_templates_mb"), ("--max-one-off-mb", "max_one_off_mb"),
        ("--result-store-mb", "result_store_mb"), ("--max-inflight-mb", "max_inflight_mb")))
    limit = container(HEAD)["resources"]["limits"]["memory"]
    assert limit.endswith("Gi") and held_mb + 1024 <= 0.9 * float(limit.removesuffix("Gi")) * 1024


def test_apply_k_applies_every_manifest():
    listed = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == [path.name for path in manifest_files()]


def worker_sizing(documents: list[dict]) -> dict[str, float]:
    """A worker's caches against its pod's memory and disk, in GiB."""
    (deployment,) = [d for d in documents if d["kind"] == "Deployment" and d["metadata"]["name"] == WORKER]
    spec = deployment["spec"]["template"]["spec"]
    (only,) = spec["containers"]
    _, flags = parse_args(only["args"])
    (cache,) = [v for v in spec["volumes"] if v["name"] == "cache"]
    gib = {"Gi": 1, "Mi": 1 / 1024, "Ti": 1024}

    def quantity(text: str) -> float:
        return float(text[:-2]) * gib[text[-2:]]

    resources = only["resources"]
    return {"host_cache": float(flags["--cache-host-gib"]), "disk_cache": float(flags["--cache-disk-gib"]),
            "memory_request": quantity(resources["requests"]["memory"]),
            "memory_limit": quantity(resources["limits"]["memory"]),
            "disk_limit": quantity(resources["limits"]["ephemeral-storage"]),
            "volume": quantity(cache["emptyDir"]["sizeLimit"])}


def check_worker_fits_its_pod(sizing: dict[str, float]) -> None:
    # Pinned cache counts against the memory limit; the process, a model loading through host memory and
    # the helpers need room beside it, or the worker is OOM-killed with its edits.
    assert sizing["host_cache"] + 8 <= sizing["memory_limit"]
    assert sizing["memory_request"] <= sizing["memory_limit"]
    # The disk tier stays inside its volume, and the volume inside the pod's ephemeral storage.
    assert sizing["disk_cache"] < sizing["volume"] <= sizing["disk_limit"]


def test_a_flux_size_worker_fits_its_pod():
    check_worker_fits_its_pod(worker_sizing(manifests()))


def test_the_smoke_deployment_serves_the_tiny_model_on_an_ordinary_gpu_node():
    """deploy/smoke: the base with small workers. A node with 16 GiB to give schedules it; the base's
    128Gi request schedules nowhere but the largest nodes."""
    documents = kustomized(REPO / "deploy" / "smoke")
    (config,) = [d for d in documents if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "retouch-config"]
    assert config["data"]["model"] == "tiny-flux-fill"
    sizing = worker_sizing(documents)
    check_worker_fits_its_pod(sizing)
    assert sizing["memory_limit"] <= 16 and sizing["disk_limit"] <= 32
    # Only the sizes changed: the patch's indices still name the cache flags.
    (worker,) = [d for d in documents if d["kind"] == "Deployment" and d["metadata"]["name"] == WORKER]
    smoke_flags = parse_args(worker["spec"]["template"]["spec"]["containers"][0]["args"])[1]
    base_flags = parse_args(container(WORKER)["args"])[1]
    assert {flag for flag in base_flags if smoke_flags.get(flag) != base_flags[flag]} == {
        "--cache-host-gib", "--cache-disk-gib"}
    assert len(documents) == len(kustomized(K8S)) == len(manifests())


def test_a_worker_is_given_time_to_finish_what_it_accepted():
    # Its drain ends when its batch and queue are answered; Kubernetes' default 30 s would recompute most
    # of a loaded Flux worker's edits elsewhere on every rolling update.
    assert pod_spec(WORKER).get("terminationGracePeriodSeconds", 30) >= 120


def test_worker_health_port_is_the_one_the_manifest_names():
    assert int(flags_of(WORKER)["--health-port"]) == 8001
    assert int(flags_of(HEAD)["--port"]) == 8000


def test_workers_have_one_gpu_each_and_the_head_none():
    resources = container(WORKER)["resources"]
    assert int(resources["limits"]["nvidia.com/gpu"]) == 1
    assert int(resources.get("requests", {}).get("nvidia.com/gpu", 1)) == 1
    assert flags_of(WORKER)["--device"] == "cuda:0"  # the pod sees its one GPU as device 0
    head = container(HEAD).get("resources", {})
    assert "nvidia.com/gpu" not in {**head.get("requests", {}), **head.get("limits", {})}


@pytest.mark.parametrize("deployment", [HEAD, WORKER])
def test_secret_volumes_name_known_secrets_and_keys(deployment):
    secret_volumes = {v["name"]: v["secret"] for v in pod_spec(deployment)["volumes"] if "secret" in v}
    assert secret_volumes
    for volume, secret in secret_volumes.items():
        assert secret["secretName"] in SECRET_KEYS, f"{volume}: unknown secret {secret['secretName']}"
        for item in secret.get("items", []):
            assert item["key"] in SECRET_KEYS[secret["secretName"]], f"{volume}: no key {item['key']}"
    for mount in container(deployment)["volumeMounts"]:
        if mount["name"] in secret_volumes:
            assert mount.get("readOnly") is True, mount["name"]


@pytest.mark.parametrize("deployment", [HEAD, WORKER])
def test_secret_files_in_args_come_from_mounted_secrets(deployment):
    flags = flags_of(deployment)
    used = [flag for flag in SECRET_FILE_FLAGS + SECRET_FOLDER_FLAGS if flag in flags]
    assert used
    for flag in used:
        if flag in SECRET_FILE_FLAGS:
            secret_key_behind(deployment, flags[flag])
        else:
            assert public_keys_in(deployment, flags[flag]), f"{flag} {flags[flag]}: no secret file under it"


def test_curve_keys_pair_up():
    head, worker = flags_of(HEAD), flags_of(WORKER)
    router_secret = secret_key_behind(HEAD, head["--curve-secret"])
    worker_secret = secret_key_behind(WORKER, worker["--curve-secret"])
    assert router_secret.endswith(".key_secret") and worker_secret.endswith(".key_secret")
    assert router_secret != worker_secret
    # The worker trusts the router's public key; the router lets in the worker's public key.
    assert secret_key_behind(WORKER, worker["--curve-server"]) == router_secret.removesuffix("_secret")
    assert public_keys_in(HEAD, head["--curve-allowed"]) == {worker_secret.removesuffix("_secret")}
    # Each side holds only its own secret key.
    assert worker_secret not in {key for _, key in mounted_secret_files(HEAD).values()}
    assert router_secret not in {key for _, key in mounted_secret_files(WORKER).values()}
    assert secret_key_behind(HEAD, head["--api-keys-file"]) == "keys"


@pytest.mark.parametrize("deployment", [HEAD, WORKER])
def test_secret_files_are_readable_by_the_non_root_user(deployment):
    spec = pod_spec(deployment)
    security = spec.get("securityContext", {})
    assert security.get("runAsNonRoot") is True
    for volume in spec["volumes"]:
        secret = volume.get("secret")
        if secret is None:
            continue
        for mode in [item.get("mode", secret.get("defaultMode", SECRET_VOLUME_DEFAULT_MODE))
                     for item in secret.get("items", [{}])]:
            # Secret files belong to root (group: fsGroup), so the user reads them as group or other.
            assert mode & 0o004 or (mode & 0o040 and "fsGroup" in security), f"{volume['name']}: mode {mode:o}"


@pytest.mark.parametrize("deployment", [HEAD, WORKER])
def test_pods_meet_the_restricted_pod_security_standard(deployment):
    """A namespace enforcing "restricted" admits the pods: non-root, the runtime's seccomp profile, no
    privilege escalation, every capability dropped."""
    spec = pod_spec(deployment)
    assert spec["securityContext"].get("runAsNonRoot") is True
    assert spec["securityContext"].get("seccompProfile") == {"type": "RuntimeDefault"}
    for each in spec["containers"]:
        assert each["securityContext"].get("allowPrivilegeEscalation") is False
        assert each["securityContext"]["capabilities"].get("drop") == ["ALL"]
    assert all(set(volume) & {"secret", "emptyDir", "persistentVolumeClaim", "configMap"} for volume in spec["volumes"])


def test_prometheus_scrapes_the_head_alone():
    """The head's /metrics re-exports every connected worker's series under the same names and labels, so
    scraping the workers too counted each worker series twice."""
    annotations = find("Deployment", WORKER)["spec"]["template"]["metadata"].get("annotations", {})
    assert "prometheus.io/scrape" not in annotations


@pytest.mark.parametrize("deployment", [HEAD])
def test_prometheus_scrapes_the_metrics_endpoint(deployment):
    annotations = find("Deployment", deployment)["spec"]["template"]["metadata"].get("annotations", {})
    assert annotations.get("prometheus.io/scrape") == "true"
    assert annotations.get("prometheus.io/path") == "/metrics"
    port = annotations.get("prometheus.io/port")
    assert isinstance(port, str), "annotation values are strings"
    assert resolve_port(deployment, port) == int(flags_of(deployment)[HTTP_PORT_FLAG[deployment]])


def test_head_and_workers_run_the_same_image_and_model():
    head, worker = container(HEAD), container(WORKER)
    assert head["image"] == worker["image"]
    assert flags_of(HEAD)["--model"] == flags_of(WORKER)["--model"]
    assert "$(" not in flags_of(HEAD)["--model"]
    # `args` keep the image's ENTRYPOINT (retouch); `command` would replace it.
    for spec in (head, worker):
        assert "command" not in spec
    assert head["args"][0] == "serve" and worker["args"][0] == "worker"


# --- the CLI -------------------------------------------------------------------------------------


@pytest.mark.parametrize("deployment", [HEAD, WORKER])
def test_manifest_flags_exist_in_the_cli(deployment):
    command, flags = parse_args(container(deployment)["args"])
    help_text = cli_help(command)
    missing = [flag for flag in flags if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text)]
    assert not missing, f"retouch {command} has no {missing}"


def test_key_generation_documented_in_the_readme_exists_in_the_cli():
    readme = (REPO / "deploy" / "README.md").read_text()
    generated = re.findall(r"retouch keys generate (\S+) --out", readme)
    assert sorted(set(generated)) == ["router", "worker"]
    assert re.search(r"(?<![\w-])--out(?![\w-])", cli_help("keys", "generate"))


# --- the Dockerfile ------------------------------------------------------------------------------


def dockerfile_stages() -> list[list[tuple[str, str]]]:
    """The Dockerfile's instructions, (KEYWORD, arguments) per stage; ARGs before the first FROM in stage 0."""
    text = re.sub(r"\\\n", " ", "\n".join(line for line in DOCKERFILE.read_text().splitlines()
                                          if not line.lstrip().startswith("#")))
    stages = [[]]
    for line in text.splitlines():
        if not line.strip():
            continue
        keyword, _, rest = line.strip().partition(" ")
        if keyword.upper() == "FROM":
            stages.append([])
        stages[-1].append((keyword.upper(), rest.strip()))
    return stages


def assignments(text: str) -> dict[str, str]:
    return dict(token.split("=", 1) for token in shlex.split(text) if "=" in token)


def base_images() -> list[str]:
    stages = dockerfile_stages()
    args = {}
    for keyword, rest in stages[0]:
        if keyword == "ARG" and "=" in rest:
            args.update(assignments(rest))
    images = []
    for stage in stages[1:]:
        image = stage[0][1].split()[0]
        images.append(re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args[m.group(1) or m.group(2)], image))
    return images


def build_step() -> tuple[int, dict[str, str], str]:
    """The stage that installs retouch (`pip install ... .`), the ENV in force there, and the command."""
    for index, stage in enumerate(dockerfile_stages()[1:]):
        env = {}
        for keyword, rest in stage:
            if keyword in ("ENV", "ARG") and "=" in rest:
                env.update(assignments(rest))
            if keyword == "RUN" and re.search(r"pip install [^&;]*--no-build-isolation[^&;]* \.(\s|$)", rest):
                return index, {**env, **assignments(rest.split("pip install")[0])}, rest
    raise AssertionError("no `pip install --no-build-isolation .` in the Dockerfile")


def final_stage() -> list[tuple[str, str]]:
    return dockerfile_stages()[-1]


def test_image_builds_on_cuda():
    images = base_images()
    assert images and all(image.startswith("nvidia/cuda:") for image in images), images
    stage, _, _ = build_step()
    assert "-devel-" in images[stage], "retouch._C needs nvcc: build on a -devel image"
    assert re.search(r"-(devel|runtime)-ubuntu2[24]\.04$", images[-1]), images[-1]


def test_extension_is_built_with_cuda_for_sm80_and_sm90():
    _, env, _ = build_step()
    arch_list = re.split(r"[;\s]+", env.get("TORCH_CUDA_ARCH_LIST", ""))
    # +PTX: a GPU newer than both (Blackwell) compiles sm_90's PTX at load, where it had no kernel at all.
    assert {"8.0", "9.0+PTX"} <= set(arch_list), arch_list
    # setup.py otherwise builds a CPU-only extension whenever torch or the toolkit lacks CUDA.
    assert env.get("RETOUCH_CUDA") == "1"


def test_image_leaves_the_test_tools_out_and_nothing_it_runs():
    """The runtime installs requirements.txt but torch (its CUDA build comes first) and the test tools; what
    `serve` and `worker` import stays in."""
    left_out = re.search(r"grep -vE '\^\(([^)]*)\)==' requirements\.txt", DOCKERFILE.read_text()).group(1).split("|")
    pinned = set(re.findall(r"^([A-Za-z0-9_.-]+)==", (REPO / "requirements.txt").read_text(), re.MULTILINE))
    assert "torch" in left_out and set(left_out) <= pinned, left_out
    assert set(left_out) - {"torch"} <= {"pytest", "pytest-xdist", "hypothesis", "playwright", "openai"}
    kept = pinned - set(left_out)
    assert {"diffusers", "pyzmq", "fastapi", "uvicorn", "prometheus-client", "standardwebhooks"} <= kept


def test_image_installs_the_pinned_torch_built_for_cuda():
    pinned = re.search(r"^torch==(\S+)", (REPO / "requirements.txt").read_text(), re.MULTILINE).group(1)
    text = DOCKERFILE.read_text()
    assert re.search(rf"torch=={re.escape(pinned)}\s+--index-url https://download\.pytorch\.org/whl/cu12\d", text)
    assert "3.11" in text and "python3.11" in text


def test_image_exposes_every_port_the_manifests_use():
    exposed = {int(port.split("/")[0])
               for keyword, rest in final_stage() if keyword == "EXPOSE" for port in rest.split()}
    used = {port for deployment in (HEAD, WORKER) for port in container_ports(deployment).values()}
    assert used and used <= exposed, f"not exposed: {used - exposed}"


def test_image_runs_retouch_as_the_manifests_user():
    entrypoints = [rest for keyword, rest in final_stage() if keyword == "ENTRYPOINT"]
    assert entrypoints and yaml.safe_load(entrypoints[-1]) == ["retouch"]  # JSON form: signals reach retouch
    users = [rest for keyword, rest in final_stage() if keyword == "USER"]
    assert users, "the image runs as root"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0")
    # runAsNonRoot can only verify a numeric USER.
    for deployment in (HEAD, WORKER):
        assert pod_spec(deployment)["securityContext"].get("runAsUser", int(user)) == int(user)


def test_dockerignore_keeps_local_builds_out_of_the_context():
    ignored = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    for entry in (".venv", "build", "out", ".git", "bench/results"):
        assert entry in ignored, entry
    assert {"*.so", "**/*.so"} & ignored and {"__pycache__", "**/__pycache__"} & ignored
