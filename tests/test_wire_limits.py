"""ddtree.verify.wire_limits on its own: the largest legal GenerateRequest passes and fits the
derived size, every cap is enforced on the wire bytes under each encoding a parser accepts
(packed or not, fields repeated and merged, the prompt oneof switching), bytes it cannot follow are
left to the parser, and on random requests it refuses exactly those the servicer's caps would."""
from __future__ import annotations

import random

import pytest

from ddtree.engine.request import (MAX_PROMPT_CHARS_PER_TOKEN, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS,
                                   MAX_STOP_TOKEN_IDS, Limits)
from ddtree.v1 import generation_pb2 as pb
from ddtree.verify.wire_limits import MAX_CLIENT_REQUEST_ID_CHARS, GenerateWireLimits

CTX = 4096
LIMITS = Limits(vocab_size=163_840, max_context=CTX, max_tokens_limit=4000, max_budget=64)  # 3-byte ids
WIRE = GenerateWireLimits(LIMITS)
WIDE = "\U0001F600"   # 4 bytes of UTF-8


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def field(number: int, payload: bytes) -> bytes:
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def widest_sampling() -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=-1, temperature=1.5, top_p=0.5, top_k=-1, seed=2**64 - 1, ignore_eos=True,
                             stop_strings=[WIDE * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS,
                             stop_token_ids=[LIMITS.vocab_size - 1] * MAX_STOP_TOKEN_IDS)


@pytest.mark.parametrize("prompt", ["text", "token_ids"])
def test_the_largest_legal_request_passes_and_fits(prompt):
    given = (dict(text=WIDE * (CTX * MAX_PROMPT_CHARS_PER_TOKEN)) if prompt == "text"
             else dict(token_ids=pb.TokenIds(ids=[LIMITS.vocab_size - 1] * (CTX - 1))))
    data = pb.GenerateRequest(**given, sampling=widest_sampling(), client_request_id=WIDE * MAX_CLIENT_REQUEST_ID_CHARS,
                              speculation=pb.SpeculationParams(mode=-1, budget=-1)).SerializeToString()
    assert WIRE.check(data) is None
    assert len(data) <= WIRE.max_bytes
    if prompt == "text":  # the bound is the text prompt's, and not much looser than it
        assert len(data) > 0.98 * WIRE.max_bytes
    assert WIRE.receive_bytes == 2 * WIRE.max_bytes


OK_IDS = field(2, field(1, varint(1) + varint(2)))


@pytest.mark.parametrize("data, message", [
    (b"\x0a" + varint(WIRE.max_bytes) + b"x" * WIRE.max_bytes,
     f"a Generate request to this server is at most {WIRE.max_bytes} bytes"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * CTX)).SerializeToString(),
     f"prompt has {CTX} tokens; the context holds {CTX}"),
    (field(2, b"".join(b"\x08\x01" for _ in range(CTX))),                       # unpacked ids
     f"prompt has {CTX} tokens"),
    (field(2, b"".join(b"\x08\x01" for _ in range(CTX + 5))),                   # past the walk's field bound
     f"prompt has more than {CTX} token ids"),
    (field(2, field(1, b"\x01" * 3000)) + field(2, field(1, b"\x01" * 1096)),   # occurrences merge
     f"prompt has {CTX} tokens"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1]), sampling=pb.SamplingParams(
        stop_strings=["x"] * 200_000)).SerializeToString(), "at most 64 stop strings, got more than 64"),
    (OK_IDS + field(3, field(7, b"a") * 40) + field(3, field(7, b"b") * 25),     # merged: 65
     "at most 64 stop strings"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1]), sampling=pb.SamplingParams(
        stop_token_ids=[5] * 5000)).SerializeToString(), "at most 1024 stop token ids, got 5000"),
    (OK_IDS + field(3, b"\x30\x05" * 1025), "at most 1024 stop token ids, got 1025"),  # unpacked
    (OK_IDS + field(3, b"\x40\x01" * 1200), "its sampling more than"),          # fields no request has
    (OK_IDS * 65, "more than 64 top-level fields"),
])
def test_refusals(data, message):
    reason = WIRE.check(data)
    assert reason is not None and message in reason, reason


def test_a_text_prompt_drops_the_ids_before_it():
    ids = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * CTX)).SerializeToString()
    assert WIRE.check(ids) is not None
    assert WIRE.check(ids + field(1, b"hello")) is None   # the oneof: the text replaced them
    assert pb.GenerateRequest.FromString(ids + field(1, b"hello")).WhichOneof("prompt") == "text"


@pytest.mark.parametrize("data", [
    b"\xff\xff\xff\xff", b"\x0a\x05ab", b"\x12\x80", b"\x0b\x01\x0c", b"\x0a" + b"\xff" * 12,
    OK_IDS + b"\x1a\x03\x3a\x05a",   # a stop string running past its SamplingParams
])
def test_bytes_it_cannot_follow_are_left_to_the_parser(data):
    assert WIRE.check(data) is None


def test_random_requests_are_refused_exactly_when_a_cap_is_passed():
    rng = random.Random(7)
    for _ in range(300):
        n_ids, n_strings, n_stop_ids = rng.choice([1, CTX - 1, CTX, CTX + 9]), rng.randrange(70), rng.randrange(1030)
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[rng.randrange(LIMITS.vocab_size)] * n_ids),
                                     sampling=pb.SamplingParams(stop_strings=["s"] * n_strings,
                                                                stop_token_ids=[rng.randrange(9)] * n_stop_ids))
        over = n_ids >= CTX or n_strings > MAX_STOP_STRINGS or n_stop_ids > MAX_STOP_TOKEN_IDS
        assert (WIRE.check(request.SerializeToString()) is not None) == over, (n_ids, n_strings, n_stop_ids)
