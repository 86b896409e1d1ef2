"""Generate requests refused on their wire bytes, before the protobuf materialises.

The servicer's caps (ddtree.engine.request: stop strings, stop token ids, the prompt against the
context) run on the parsed message, and parsing is what costs: a request with 200,000 stop strings
(600 KB on the wire) became 200,000 strings in upb's arena, left 0.3-1 MiB of C heap behind in the
verify process each time, and grew it by 9% over an 8-minute soak. `GenerateWireLimits` is the
verify server's request check (ddtree.rpc.decoding runs it on the bytes, before the
deserializer), in three layers:

- `max_bytes`, the largest legal GenerateRequest of this server, derived from its limits: a prompt
  of max_context x MAX_PROMPT_CHARS_PER_TOKEN characters at 4 UTF-8 bytes each (or max_context - 1
  token ids), 64 stop strings of 512 characters, 1024 stop token ids, a client request id of
  MAX_CLIENT_REQUEST_ID_CHARS, every scalar at its widest, and 4 KiB for fields newer clients may
  add. A longer request gets INVALID_ARGUMENT saying so, unparsed.
- a walk over the top-level fields, TokenIds and SamplingParams (skipping every value by its length
  prefix, counting packed varints in C with bytes.translate) that refuses more prompt ids than the
  context, more than 64 stop strings (stopping at the 65th) or more than 1024 stop token ids with
  the servicer's own messages; a field count no legal request reaches bounds the walk itself.
  Bytes the walk cannot follow are left to the parser, which answers them as undecodable.
- `receive_bytes` (2 x max_bytes) is the server's gRPC max receive message length: grpc refuses a
  message past it at the transport with RESOURCE_EXHAUSTED "Received message larger than max (N vs.
  M)" before Python sees a byte, so a 100 MB prompt never becomes a 100 MB buffer.
"""
from __future__ import annotations

from ddtree.engine.request import (MAX_PROMPT_CHARS_PER_TOKEN, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS,
                                   MAX_STOP_TOKEN_IDS, Limits)

GENERATE = "/ddtree.v1.Generation/Generate"
MAX_CLIENT_REQUEST_ID_CHARS = 256   # the servicer refuses a longer client_request_id
SLACK_BYTES = 4096                  # fields a newer client may add
UTF8_MAX = 4                        # bytes per character
SCALAR_MAX = 11                     # tag + a 10-byte varint
TOP_FIELDS_MAX = 64                 # a serializer writes each of GenerateRequest's 5 fields once
_HIGH = bytes(range(0x80, 0x100))   # deleted by translate: what remains is one byte per varint


def varint_len(value: int) -> int:
    return max(1, (value.bit_length() + 6) // 7)


def _bytes_field(n: int) -> int:
    """tag + length prefix + n bytes."""
    return 1 + varint_len(n) + n


def max_request_bytes(limits: Limits) -> int:
    """The largest GenerateRequest `limits` can accept (module docstring)."""
    id_bytes = 1 + varint_len(max(limits.vocab_size - 1, 0))   # unpacked: a tag each (packed needs less)
    text = _bytes_field(UTF8_MAX * limits.max_context * MAX_PROMPT_CHARS_PER_TOKEN)
    ids = _bytes_field(_bytes_field((limits.max_context - 1) * id_bytes))
    stop_ids = _bytes_field(MAX_STOP_TOKEN_IDS * id_bytes)
    stop_strings = MAX_STOP_STRINGS * _bytes_field(UTF8_MAX * MAX_STOP_STRING_CHARS)
    sampling = _bytes_field(6 * SCALAR_MAX + stop_ids + stop_strings)
    speculation = _bytes_field(2 * SCALAR_MAX)
    client_id = _bytes_field(UTF8_MAX * MAX_CLIENT_REQUEST_ID_CHARS)
    return max(text, ids) + sampling + speculation + client_id + SLACK_BYTES


class _Unfollowable(Exception):
    """Bytes the walk cannot follow: left to the parser."""


class _TooMany(Exception):
    pass


def _varint(data: bytes, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while pos < end and shift < 70:
        b = data[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7
    raise _Unfollowable


def _fields(data: bytes, pos: int, end: int, most: int):
    """(field number, wire type, value start, value end) of each field in data[pos:end]; _TooMany
    past `most` of them."""
    count = 0
    while pos < end:
        count += 1
        if count > most:
            raise _TooMany
        key, pos = _varint(data, pos, end)
        field, wire = key >> 3, key & 7
        if wire == 0:
            start = pos
            _, pos = _varint(data, pos, end)
        elif wire == 2:
            n, start = _varint(data, pos, end)
            pos = start + n
        elif wire in (1, 5):
            start, pos = pos, pos + (8 if wire == 1 else 4)
        else:  # groups (3, 4) and invalid types: the parser's to judge
            raise _Unfollowable
        if pos > end:
            raise _Unfollowable
        yield field, wire, start, pos


def _packed_count(data: bytes, start: int, end: int) -> int:
    return len(data[start:end].translate(None, _HIGH))


class GenerateWireLimits:
    """`check(data)`: None, or why a GenerateRequest is refused (module docstring)."""

    def __init__(self, limits: Limits):
        self.limits = limits
        self.max_bytes = max_request_bytes(limits)
        self.receive_bytes = 2 * self.max_bytes
        self._sampling_fields_max = MAX_STOP_STRINGS + MAX_STOP_TOKEN_IDS + 64

    def describe(self) -> str:
        ctx = self.limits.max_context
        return (f"a prompt of at most {ctx - 1} token ids or {ctx * MAX_PROMPT_CHARS_PER_TOKEN} characters "
                f"(max_context {ctx}), {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_STRING_CHARS} "
                f"characters, {MAX_STOP_TOKEN_IDS} stop token ids")

    def check(self, data: bytes) -> str | None:
        if len(data) > self.max_bytes:
            return (f"the request is {len(data)} bytes; a Generate request to this server is at most "
                    f"{self.max_bytes} bytes ({self.describe()})")
        try:
            return self._walk(data)
        except _Unfollowable:
            return None  # the parser says what is wrong with it
        except _TooMany:
            return (f"the request has more than {TOP_FIELDS_MAX} top-level fields or its sampling more than "
                    f"{self._sampling_fields_max}; a legal GenerateRequest has far fewer")

    def _walk(self, data: bytes) -> str | None:
        ids = stop_strings = stop_ids = sampling_fields = 0
        ctx = self.limits.max_context
        for field, wire, start, end in _fields(data, 0, len(data), TOP_FIELDS_MAX):
            if field == 1:        # text: the oneof drops the token ids read so far
                ids = 0
            elif field == 2 and wire == 2:   # TokenIds (repeated occurrences merge)
                try:
                    for f, w, a, b in _fields(data, start, end, ctx):   # unpacked ids: a field each
                        if f == 1:
                            ids += _packed_count(data, a, b) if w == 2 else 1
                except _TooMany:
                    return (f"prompt has more than {ctx} token ids; the context holds {ctx} "
                            "(prompt + at least one generated token)")
            elif field == 3 and wire == 2:   # SamplingParams (repeated occurrences merge)
                for f, w, a, b in _fields(data, start, end, self._sampling_fields_max - sampling_fields):
                    sampling_fields += 1
                    if f == 7:
                        stop_strings += 1
                        if stop_strings > MAX_STOP_STRINGS:
                            return f"at most {MAX_STOP_STRINGS} stop strings, got more than {MAX_STOP_STRINGS}"
                    elif f == 6:
                        stop_ids += _packed_count(data, a, b) if w == 2 else 1
        if ids >= ctx:   # after the walk: a text field later in the bytes would have dropped them
            return f"prompt has {ids} tokens; the context holds {ctx} (prompt + at least one generated token)"
        if stop_ids > MAX_STOP_TOKEN_IDS:
            return f"at most {MAX_STOP_TOKEN_IDS} stop token ids, got {stop_ids}"
        return None
