"""Packaging facts: stubs are current, the client imports no torch, the CLIs and _C answer."""
from __future__ import annotations

import filecmp
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_proto_stubs_are_current(tmp_path):
    pytest.importorskip("grpc_tools")
    subprocess.run([sys.executable, str(ROOT / "tools" / "gen_proto.py"), "--out", str(tmp_path)],
                   check=True, capture_output=True, timeout=120)
    fresh = sorted(p.name for p in (tmp_path / "ddtree" / "v1").glob("*_pb2*"))
    committed = sorted(p.name for p in (ROOT / "services" / "ddtree" / "v1").glob("*_pb2*"))
    assert fresh == committed, "stub files differ: run python tools/gen_proto.py"
    stale = [n for n in fresh
             if not filecmp.cmp(tmp_path / "ddtree" / "v1" / n, ROOT / "services" / "ddtree" / "v1" / n, shallow=False)]
    assert not stale, f"stale generated stubs {stale}: run python tools/gen_proto.py"


def test_importing_the_client_does_not_import_torch():
    code = ("import sys, ddtree_client, ddtree_client.cli, ddtree_client.channel; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("command", ["ddtree", "ddtree-client"])
def test_console_scripts_have_help_and_version(command):
    exe = pathlib.Path(sys.executable).parent / command
    help_out = subprocess.run([exe, "--help"], check=True, capture_output=True, text=True, timeout=60)
    assert "usage:" in help_out.stdout
    version = subprocess.run([exe, "--version"], check=True, capture_output=True, text=True, timeout=60)
    assert "0." in version.stdout


def test_native_extension_reports_its_build():
    from ddtree import native

    info = native.build_info()
    assert isinstance(info["cuda"], bool)
    assert native.cuda_kernels_built() == info["cuda"]
    assert (info["cuda_runtime_version"] > 0) == info["cuda"]
    exe = pathlib.Path(sys.executable).parent / "ddtree"
    out = subprocess.run([exe, "info", "--json"], check=True, capture_output=True, text=True, timeout=60)
    assert json.loads(out.stdout)["native"]["cuda"] == info["cuda"]
