"""`ddtree` and `ddtree-client`: every option's --help shows its default, `ddtree info` reads as
sentences, and a reader that closes the pipe early ends the command quietly."""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from ddtree.cli import DefaultsHelpFormatter


def parsers(parser: argparse.ArgumentParser, name: str):
    """(command name, parser) for `parser` and every subcommand under it."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from parsers(sub, f"{name} {sub_name}")


def all_parsers():
    from ddtree.cli import build_parser as ddtree_parser
    from ddtree_client.cli import build_parser as client_parser

    return [*parsers(ddtree_parser(), "ddtree"), *parsers(client_parser(), "ddtree-client")]


def test_every_option_shows_its_default():
    missing = []
    for name, parser in all_parsers():
        parser.format_help()  # every help string formats (a bare "%" in one crashed `--help`)
        formatter = parser._get_formatter()
        assert isinstance(formatter, DefaultsHelpFormatter), f"{name}: {type(formatter).__name__}"
        for action in parser._actions:
            if not action.option_strings or action.nargs == 0 or action.default is argparse.SUPPRESS:
                continue  # positionals, on/off flags, --help / --version, required ones
            if "default" not in formatter._get_help_string(action).lower():
                missing.append(f"{name} {action.option_strings[0]}")
    assert not missing, missing
    # and the formatter puts it there: a bare option gets "(default: X)", one that says it is kept
    p = argparse.ArgumentParser(formatter_class=DefaultsHelpFormatter)
    p.add_argument("--n", type=int, default=3, help="count")
    p.add_argument("--m", default=None, help="mode")
    p.add_argument("--k", default=5, help="k (default 5)")
    text = p.format_help()
    assert "count (default: 3)" in text and "mode (default: none)" in text and "(default 5)" in text
    assert "default: 5" not in text


def ddtree_exe() -> str:
    return str(Path(sys.executable).parent / "ddtree")


def test_info_is_readable():
    out = subprocess.run([ddtree_exe(), "info"], capture_output=True, text=True, timeout=120, check=True).stdout
    names = [line[:18].strip() for line in out.splitlines()]
    assert names == ["ddtree-serve", "native extension", "GPUs", "torch"], out
    assert "kernels" in out and "{" not in out, "sentences, not Python dicts"


def test_a_closed_pipe_ends_quietly():
    """`ddtree info | head -0`: the reader is gone before the first write."""
    proc = subprocess.Popen([ddtree_exe(), "info"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(120) == 141 and "Traceback" not in err and "BrokenPipe" not in err, err


def test_up_checks_model_paths_before_starting_anything(tmp_path):
    argv = ["up", "--target", "/nonexistent", "--drafter", "/nonexistent"]
    out = subprocess.run([ddtree_exe(), *argv], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--target /nonexistent: no such directory" in out.stderr
    assert "Traceback" not in out.stderr and "listening" not in out.stdout
    (tmp_path / "config.json").write_text("{}")
    out = subprocess.run([ddtree_exe(), "up", "--target", str(tmp_path), "--drafter", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and f"--target {tmp_path}: no *.safetensors weights there" in out.stderr
