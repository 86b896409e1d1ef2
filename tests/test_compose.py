"""compose.yaml agrees with the CLI: every command it runs parses, and the ports line up.

Docker is not needed: the file is read with PyYAML (compose's ${VAR:-default} interpolation is
applied with the defaults) and each command is parsed by the real argparse parsers of `ddtree`
and `ddtree-client`.
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]


def interpolate(value):
    if isinstance(value, str):
        return re.sub(r"\$\{(\w+)(?::?-([^}]*))?\}", lambda m: m.group(2) or "", value)
    if isinstance(value, list):
        return [interpolate(v) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v) for k, v in value.items()}
    return value


@pytest.fixture(scope="module")
def compose():
    return interpolate(yaml.safe_load((ROOT / "compose.yaml").read_text()))


def parse(command: list[str]) -> argparse.Namespace:
    if command[0] == "ddtree":
        from ddtree.cli import build_parser

        parser = build_parser()
    elif command[0] == "ddtree-client":
        from ddtree_client.cli import build_parser

        parser = build_parser()
    else:
        raise AssertionError(f"unknown program {command[0]!r}")
    try:
        return parser.parse_args(command[1:])
    except SystemExit as exc:
        raise AssertionError(f"{' '.join(command)} does not parse (exit {exc.code})") from None


def port_of(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def test_every_command_exists_and_parses(compose):
    for name, service in compose["services"].items():
        for command in [service.get("command"), (service.get("healthcheck") or {}).get("test", [None, None])[1:]]:
            if command and command[0] in ("ddtree", "ddtree-client"):
                args = parse(command)
                assert callable(getattr(args, "func", None)), f"{name}: {command} selects no command"


def test_ports_and_endpoints_agree(compose):
    s = compose["services"]
    verify, drafter, treebuild = (parse(s[n]["command"]) for n in ("verify", "drafter", "treebuild"))
    assert verify.port == 50051 and verify.host == "0.0.0.0"
    assert port_of(verify.drafter_endpoint) == drafter.port and port_of(verify.treebuild_endpoint) == treebuild.port
    assert drafter.host == treebuild.host == "127.0.0.1"  # internal endpoints on loopback
    assert verify.drafter == drafter.drafter and verify.target == drafter.target
    for name, args in (("verify", verify), ("drafter", drafter), ("treebuild", treebuild)):
        health = parse(s[name]["healthcheck"]["test"][1:])
        assert health.command == "health" and port_of(health.target) == args.port, name
    http = parse(s["http"]["command"])
    assert port_of(http.verify) == verify.port and http.target == verify.target and http.host == "0.0.0.0"
    assert f"127.0.0.1:{http.port}/health" in s["http"]["healthcheck"]["test"][-1]
    assert s["http"]["depends_on"]["verify"]["condition"] == "service_healthy"
    load = parse(s["loadtest"]["command"])
    assert port_of(load.target) == verify.port and s["loadtest"]["profiles"] == ["loadtest"]
    assert {"4317:4317", "16686:16686"} <= set(s["jaeger"]["ports"])
    assert s["jaeger"]["image"].startswith("jaegertracing/all-in-one")


def test_gpu_ipc_pid_and_tracing_environment(compose):
    for name in ("verify", "drafter", "treebuild"):
        svc = compose["services"][name]
        assert svc["ipc"] == "host" and svc["pid"] == "host" and svc["network_mode"] == "host", name
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"], name
        env = svc["environment"]
        assert port_of(env["OTEL_EXPORTER_OTLP_ENDPOINT"]) == 4317 and env["OTEL_SERVICE_NAME"] == f"ddtree-{name}"
        assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:False"
        assert svc["build"] == "." and (ROOT / "Dockerfile").is_file()
    deps = compose["services"]["verify"]["depends_on"]
    assert deps["drafter"]["condition"] == deps["treebuild"]["condition"] == "service_healthy"


def test_dockerfile_installs_the_entry_points():
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"pip install --no-build-isolation \.", text) and "nvidia/cuda" in text
    for path in re.findall(r"^COPY (\S+) ", text, flags=re.M):
        assert (ROOT / path).exists(), f"Dockerfile copies {path}, which does not exist"
