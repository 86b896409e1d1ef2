"""benchmarks/sass_loop_model.py on a hand-made SASS listing: control-bit decoding, loop choice and
the replay's arithmetic (stall counts plus scoreboard waits)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("sass_loop_model", ROOT / "benchmarks/sass_loop_model.py")
model = importlib.util.module_from_spec(spec)
spec.loader.exec_module(model)


def _ins(addr: int, text: str, stall: int, wbar: int = 7, rbar: int = 7, wait: int = 0) -> list[str]:
    ctrl = stall | (1 << 4) | (wbar << 5) | (rbar << 8) | (wait << 11)
    return [f"        /*{addr:04x}*/                   {text} ;   /* 0x0000000000000000 */",
            f"                                                 /* {ctrl << 41:#018x} */"]


def _listing() -> str:
    lines = ["\t\tFunction : _Z5otherv"] + _ins(0x0, "NOP", 1)
    lines += ["\t\tFunction : _Z4loopv"]
    lines += _ins(0x00, "MOV R1, RZ", 1)
    lines += _ins(0x10, "LDS.64 R2, [R1]", 2, wbar=0)                      # releases barrier 0 after 30
    lines += _ins(0x20, "DADD R4, R2, R2", 3, wait=0b1)                     # waits for the load
    lines += _ins(0x30, "VOTE.ANY R5, PT, P0", 2)
    lines += _ins(0x40, "@P1 BRA 0x10", 5)                                  # the loop: 0x10-0x40
    lines += _ins(0x50, "@P2 BRA 0x0", 5)                                   # an outer loop
    lines += _ins(0x60, "EXIT", 5)
    return "\n".join(lines)


def test_parse_reads_the_control_bits_of_the_named_function():
    ins = model.parse(model.function_lines(_listing(), "_Z4loopv"))
    assert [x["addr"] for x in ins] == [0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60]
    lds = ins[1]
    assert (lds["stall"], lds["wbar"], lds["rbar"], lds["wait"]) == (2, 0, 7, 0)
    assert ins[2]["wait"] == 0b1 and ins[2]["text"] == "DADD R4, R2, R2"


def test_innermost_loop_and_the_opcode_filter():
    ins = model.parse(model.function_lines(_listing(), "_Z4loopv"))
    assert model.innermost_loop(ins, []) == (0x10, 0x40)
    assert model.innermost_loop(ins, ["VOTE"]) == (0x10, 0x40)
    assert model.innermost_loop(ins, ["MOV"]) == (0x00, 0x50)


def test_replay_adds_stalls_and_scoreboard_waits():
    ins = model.parse(model.function_lines(_listing(), "_Z4loopv"))
    body = [x for x in ins if 0x10 <= x["addr"] <= 0x40]
    # One pass: LDS at 0 (+2), DADD waits for 0 + 30 (+3), VOTE at 33 (+2), BRA at 35 (+5) = 40; the
    # next pass's load issues at 40 and its add waits until 70, so every pass takes 40 cycles.
    assert model.replay(body, iterations=1) == 40
    assert model.replay(body, iterations=3) == 40
