"""Deployment files: docker-compose.yml with its GPU override (what `docker compose up` reads)
and with docker-compose.cpu.yml, as `docker-compose config` resolves them, the Kubernetes
manifests against the API schemas (kubernetes-validate bundles them: no cluster, no network),
and the Dockerfile. No Docker engine is needed: tests/system/test_deploy_fleet.py builds and
runs them."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from conftest import require_command

REPO = Path(__file__).resolve().parents[1]
COMPOSE_FILE = REPO / "docker-compose.yml"
CPU_OVERRIDE = REPO / "docker-compose.cpu.yml"
DOCKERFILE = REPO / "docker" / "Dockerfile"
K8S_DIR = REPO / "deploy" / "k8s"
PASSWORD = "compose-test-password"
PLACEHOLDER = "CHANGE_ME"
HPO_SERVICES = ("init", "dashboard")
# Kubernetes versions the manifests must be valid for: an old supported one and the newest
# schemas the installed kubernetes-validate bundles.
K8S_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
# scheme://user:password@host: the password part of any URL with credentials.
URL_PASSWORD = re.compile(r"://[^:/@\s]+:([^@\s]+)@")


# --- docker-compose.yml --------------------------------------------------------------------


def compose_command() -> list[str]:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
        if probe.returncode == 0:
            return ["docker", "compose"]
    return [require_command("docker-compose", "docker-compose")]


def compose_env(**extra: str) -> dict[str, str]:
    """The environment without POSTGRES_PASSWORD, HPO_* or COMPOSE_* settings that could
    change what `config` reads."""
    env = {key: value for key, value in os.environ.items()
           if key != "POSTGRES_PASSWORD" and not key.startswith(("COMPOSE_", "HPO_"))}
    return {**env, **extra}


def run_compose_config(project: Path, env: dict[str, str], env_file: Path,
                       files: tuple[Path, ...] = ()):
    """`config` of `files`; none named: what `docker compose up` reads in `project`
    (docker-compose.yml and docker-compose.override.yml)."""
    # --env-file: a developer's own .env must not decide the outcome.
    named = [arg for file in files for arg in ("-f", str(file))]
    command = [*compose_command(), "--project-directory", str(project), *named,
               "--env-file", str(env_file), "config"]
    return subprocess.run(command, cwd=project, env=env, capture_output=True, text=True,
                          timeout=60)


def resolved(tmp_path_factory, files: tuple[Path, ...] = (), **env: str) -> dict:
    empty = tmp_path_factory.mktemp("compose-env") / "empty.env"
    empty.write_text("")
    result = run_compose_config(REPO, compose_env(POSTGRES_PASSWORD=PASSWORD, **env), empty,
                                files)
    assert result.returncode == 0, f"docker-compose config failed:\n{result.stderr}"
    return yaml.safe_load(result.stdout)


@pytest.fixture(scope="module")
def compose(tmp_path_factory) -> dict:
    """The GPU host's fleet: `docker compose up` with no file named."""
    return resolved(tmp_path_factory)


@pytest.fixture(scope="module")
def cpu_compose(tmp_path_factory) -> dict:
    return resolved(tmp_path_factory, (COMPOSE_FILE, CPU_OVERRIDE))


def workers(compose: dict) -> dict[str, dict]:
    return {name: service for name, service in compose["services"].items()
            if name.startswith("worker-")}


def depends_on(service: dict, name: str) -> str | None:
    """The condition `service` waits for on `name` (None: no dependency)."""
    deps = service.get("depends_on") or {}
    if isinstance(deps, list):
        return "service_started" if name in deps else None
    entry = deps.get(name)
    return None if entry is None else entry.get("condition", "service_started")


def host_ips(port) -> str | None:
    """The host address of a published port, in compose v1 (string) or v2 (mapping) form."""
    if isinstance(port, dict):
        return port.get("host_ip")
    parts = str(port).split(":")
    return parts[0] if len(parts) == 3 else None


def test_compose_postgres_is_pinned_and_has_a_pg_isready_healthcheck(compose):
    postgres = compose["services"]["postgres"]
    name, _, tag = postgres["image"].partition(":")
    assert name == "postgres"
    assert tag and tag != "latest" and re.match(r"\d+(\.\d+)+", tag), postgres["image"]
    test = postgres["healthcheck"]["test"]
    test = " ".join(test) if isinstance(test, list) else test
    assert "pg_isready" in test and "-U hpo" in test and "-d hpo" in test
    assert postgres["environment"]["POSTGRES_PASSWORD"] == PASSWORD
    assert postgres["environment"]["POSTGRES_USER"] == "hpo"
    assert postgres["environment"]["POSTGRES_DB"] == "hpo"
    assert postgres["stop_signal"] == "SIGINT"  # a fast shutdown, on a stand-in image too


def test_compose_start_order(compose):
    services = compose["services"]
    assert depends_on(services["init"], "postgres") == "service_healthy"
    assert str(services["init"].get("restart", "no")) in ("no", "False", "false")
    assert services["init"]["command"] == ["create", "--study", "redsm5"]
    assert len(workers(compose)) >= 2
    for name, service in {**workers(compose), "dashboard": services["dashboard"]}.items():
        assert depends_on(service, "init") == "service_completed_successfully", name


def test_compose_workers_have_one_distinct_gpu_each(compose):
    seen: list[str] = []
    for name, service in workers(compose).items():
        assert service["command"] == ["run", "--study", "redsm5", "--n-trials", "200"], name
        assert str(service["restart"]).startswith("on-failure"), name
        assert service["stop_grace_period"] == "30s", name  # time to re-queue its trial
        assert "replicas" not in service.get("deploy", {}), name
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert len(devices) == 1, name
        (device,) = devices
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"], name
        assert "count" not in device, f"{name}: pin a device id, not a count"
        assert len(device["device_ids"]) == 1, name
        seen.append(str(device["device_ids"][0]))
    assert len(seen) == len(set(seen)), f"two workers share a GPU: {seen}"


def test_compose_cpu_override_reserves_no_gpu_and_gives_workers_one_thread(compose,
                                                                         cpu_compose):
    assert set(cpu_compose["services"]) == set(compose["services"])
    for name, service in cpu_compose["services"].items():
        assert "nvidia" not in json.dumps(service), name
    for name in (*workers(cpu_compose), "init"):
        assert cpu_compose["services"][name]["environment"]["OMP_NUM_THREADS"] == "1", name
    # Otherwise the same fleet: commands, storage, volumes, restart policies.
    for name, service in compose["services"].items():
        ours = cpu_compose["services"][name]
        for key in ("command", "volumes", "restart", "stop_grace_period", "depends_on", "image",
                    "ports"):
            assert ours.get(key) == service.get(key), (name, key)


def test_compose_images_and_ports_default_to_the_real_ones_and_follow_the_environment(
        compose, tmp_path_factory):
    services = compose["services"]
    assert services["worker-0"]["image"] == "hpo:latest"
    assert services["worker-0"]["build"]["args"]["BASE_IMAGE"] == dockerfile_base_default()
    changed = resolved(tmp_path_factory, (COMPOSE_FILE, CPU_OVERRIDE),
                       HPO_IMAGE="hpo-test/hpo:t", HPO_BASE_IMAGE="hpo-test/base:t",
                       HPO_POSTGRES_IMAGE="hpo-test/postgres:t", HPO_POSTGRES_PORT="15432",
                       HPO_DASHBOARD_PORT="18080", HPO_CPU_THREADS="2")["services"]
    assert changed["postgres"]["image"] == "hpo-test/postgres:t"
    for name in (*HPO_SERVICES, *workers(compose)):
        assert changed[name]["image"] == "hpo-test/hpo:t", name
        assert changed[name]["build"]["args"]["BASE_IMAGE"] == "hpo-test/base:t", name
    assert "15432" in json.dumps(changed["postgres"]["ports"])
    assert "18080" in json.dumps(changed["dashboard"]["ports"])
    assert changed["worker-1"]["environment"]["OMP_NUM_THREADS"] == "2"


def test_compose_hpo_services_get_the_storage_url_from_the_password(compose):
    url = f"postgresql+psycopg2://hpo:{PASSWORD}@postgres:5432/hpo"
    names = [*HPO_SERVICES, *workers(compose)]
    for name in names:
        service = compose["services"][name]
        assert service["environment"]["HPO_STORAGE"] == url, name
        assert service["image"] == compose["services"]["worker-0"]["image"], name
    dashboard = compose["services"]["dashboard"]["command"]
    assert dashboard[:1] == ["dashboard"] and "--host" in dashboard and "--port" in dashboard


def test_compose_publishes_ports_on_localhost_only(compose):
    published = 0
    for name, service in compose["services"].items():
        for port in service.get("ports", []):
            published += 1
            assert host_ips(port) == "127.0.0.1", f"{name} publishes {port} beyond localhost"
    assert published >= 1
    assert any("8080" in str(port) for port in compose["services"]["dashboard"]["ports"])


def test_compose_file_holds_no_literal_password():
    text = COMPOSE_FILE.read_text()
    for password in URL_PASSWORD.findall(text):
        assert password.startswith("${POSTGRES_PASSWORD"), password
    for line in text.splitlines():
        if re.match(r"\s*POSTGRES_PASSWORD\s*:", line):
            assert "${POSTGRES_PASSWORD:?" in line, line


def test_compose_refuses_to_start_without_a_password(tmp_path):
    # A copy with no .env beside it, and an environment without the variable.
    shutil.copy(COMPOSE_FILE, tmp_path / "docker-compose.yml")
    assert not (tmp_path / ".env").exists()
    empty = tmp_path / "empty.env"
    empty.write_text("")
    result = run_compose_config(tmp_path, compose_env(), empty)
    assert result.returncode != 0, "compose config succeeded without POSTGRES_PASSWORD"
    assert "POSTGRES_PASSWORD" in result.stdout + result.stderr


def test_env_example_documents_the_password_without_a_value():
    lines = (REPO / ".env.example").read_text().splitlines()
    assert "POSTGRES_PASSWORD=" in lines
    ignored = (REPO / ".dockerignore").read_text().splitlines()
    assert ".env" in ignored and "data/" in ignored


# --- Kubernetes manifests ------------------------------------------------------------------


@pytest.fixture(scope="module")
def manifests() -> list[dict]:
    docs = []
    for path in sorted(K8S_DIR.glob("*.yaml")):
        docs += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    assert docs, f"no manifests in {K8S_DIR}"
    return docs


def of_kind(manifests: list[dict], kind: str) -> list[dict]:
    return [doc for doc in manifests if doc["kind"] == kind]


def pod_containers(pod_spec: dict) -> list[dict]:
    return [*pod_spec.get("initContainers", []), *pod_spec["containers"]]


def strings(node):
    if isinstance(node, dict):
        for value in node.values():
            yield from strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from strings(value)
    elif isinstance(node, str):
        yield node


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_k8s_manifests_match_the_api_schemas(manifests, version):
    for doc in manifests:
        name = f"{doc['kind']}/{doc['metadata']['name']}"
        try:  # strict: unknown fields (typos) are errors too; unknown kinds raise
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{name} is not valid for Kubernetes {version}: "
                        f"{'.'.join(map(str, exc.path))}: {exc.message}")


def test_k8s_workers_are_an_indexed_job_with_one_gpu_per_pod(manifests):
    (job,) = of_kind(manifests, "Job")
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] >= 2
    pod = spec["template"]["spec"]
    (worker,) = pod["containers"]
    assert [*worker["command"], *worker["args"]][:4] == ["hpo", "run", "--study", "redsm5"]
    assert "--n-trials" in worker["args"]
    init = [[*c["command"], *c["args"]] for c in pod.get("initContainers", [])]
    assert ["hpo", "create", "--study", "redsm5"] in init
    for container in pod_containers(pod):
        limits = container["resources"]["limits"]
        assert int(limits["nvidia.com/gpu"]) == 1, container["name"]


def test_k8s_storage_url_comes_from_the_secret(manifests):
    (secret,) = of_kind(manifests, "Secret")
    keys = set(secret.get("stringData", {})) | set(secret.get("data", {}))
    pods = [doc["spec"]["template"]["spec"] for doc in manifests
            if doc["kind"] in ("Job", "Deployment")]
    checked = 0
    for pod in pods:
        for container in pod_containers(pod):
            env = {item["name"]: item for item in container.get("env", [])}
            storage = env["HPO_STORAGE"]
            assert "value" not in storage, f"{container['name']}: HPO_STORAGE given in clear"
            ref = storage["valueFrom"]["secretKeyRef"]
            assert ref["name"] == secret["metadata"]["name"] and ref["key"] in keys
            checked += 1
    assert checked >= 3  # the worker, its init container and the dashboard


def test_k8s_manifests_hold_no_password_but_the_placeholder(manifests):
    found = [password for doc in manifests for text in strings(doc)
             for password in URL_PASSWORD.findall(text)]
    assert found, "the example Secret should show the URL format with a placeholder"
    assert set(found) == {PLACEHOLDER}, found


def test_k8s_dashboard_is_internal_only(manifests):
    (deployment,) = of_kind(manifests, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    command = [*container["command"], *container["args"]]
    assert command[:2] == ["hpo", "dashboard"] and "8080" in command
    (service,) = of_kind(manifests, "Service")
    assert service["spec"].get("type", "ClusterIP") == "ClusterIP"
    assert [port["port"] for port in service["spec"]["ports"]] == [8080]
    assert not of_kind(manifests, "Ingress")


def test_k8s_images_are_tagged(manifests):
    pods = [doc["spec"] for doc in of_kind(manifests, "Pod")]
    pods += [doc["spec"]["template"]["spec"] for doc in manifests
             if doc["kind"] in ("Job", "Deployment")]
    for pod in pods:
        for container in pod_containers(pod):
            tag = container["image"].rpartition(":")[2]
            assert tag and "/" not in tag and tag != "latest", container["image"]


# --- Dockerfile ----------------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    pairs = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            pairs.append((word.upper(), rest.strip()))
    return pairs


def instruction(name: str) -> list[str]:
    return [rest for word, rest in dockerfile_instructions() if word == name]


def dockerfile_base_default() -> str:
    (line,) = [rest for rest in instruction("ARG") if rest.startswith("BASE_IMAGE=")]
    return line.partition("=")[2]


def test_dockerfile_base_image_is_an_argument_defaulting_to_a_pinned_cuda_pytorch_runtime():
    # The requirements stage and the image both start from it: no other image is pulled.
    assert instruction("FROM") == ["${BASE_IMAGE} AS requirements", "${BASE_IMAGE}"]
    base = dockerfile_base_default()
    assert re.fullmatch(r"pytorch/pytorch:\d+\.\d+\.\d+-cuda\d+\.\d+-cudnn\d+-runtime", base), base


def test_dockerfile_runs_hpo_as_a_worker_by_default():
    assert [json.loads(rest) for rest in instruction("ENTRYPOINT")] == [["hpo"]]
    (cmd,) = instruction("CMD")
    assert json.loads(cmd) == ["run", "--study", "redsm5", "--n-trials", "200"]
    # With boto3, for an S3 artifact store of the kept models.
    assert any("pip install --no-cache-dir '.[s3]'" in rest for rest in instruction("RUN"))
    # The dependencies' layer is keyed by their list alone, not by all of pyproject.toml.
    copies = instruction("COPY")
    assert copies.index("--from=requirements /requirements.txt /tmp/requirements.txt") < (
        copies.index("pyproject.toml README.md ./"))
    users = instruction("USER")
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert instruction("WORKDIR") == ["/app"]
    assert not any("HF_HUB_OFFLINE" in rest for rest in instruction("ENV"))
