"""The OpenAI-compatible HTTP API against a real stack on localhost, through the official `openai`
client: the verify service (bundled pair, CPU, drafter in process) and `ddtree serve http` as
subprocesses, one pair for the module.

Completions and chat, streamed and not, with usage; stop strings (left out of the text) and
max_tokens; /v1/models and /health; greedy output equal to the gRPC API's for the same prompt
ids and mode; bad input -> 400 with OpenAI's error body; a wrong model -> 404; /metrics parsed
with prometheus_client; a client that disconnects cancels the request in the verify service.
Without a server: chat templates (tokenizer_config.json's, as transformers renders it; the
built-in one), the BOS rule, stop trimming across chunks, the gRPC -> HTTP status map.
"""
from __future__ import annotations

import http.client
import json
import os
import re
import time

import grpc
import pytest

openai = pytest.importorskip("openai")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from test_verify_service import Service, service_env  # noqa: E402

from ddtree.demo import bundled_pair, prompt_ids  # noqa: E402
from ddtree.rpc.health import wait_until_http_ok  # noqa: E402
from ddtree.waiting import wait_until  # noqa: E402
from ddtree.http.chat_template import BYTE_LEVEL_TEMPLATE, ChatTemplate  # noqa: E402
from ddtree.http.errors import APIError, from_grpc  # noqa: E402
from ddtree.http.prompts import Prompts  # noqa: E402
from ddtree.prompting import TokenizerConfig  # noqa: E402
from ddtree.http.stops import StopTrimmer  # noqa: E402
from ddtree.up import free_port  # noqa: E402
from ddtree.v1 import generation_pb2 as pb  # noqa: E402
from ddtree.v1 import generation_pb2_grpc  # noqa: E402

PROMPT = "def read_lines(path):\n    "
CONVERSATION = [{"role": "system", "content": "Helpers for text files."},
                {"role": "user", "content": "Return the lines of a file.\nStrip the newlines."}]


@pytest.fixture(scope="module")
def pair():
    return bundled_pair(None)


@pytest.fixture(scope="module")
def stack(pair):
    """(verify Service, HTTP port): both started at once; the HTTP front waits for verify itself."""
    target, drafter = pair
    env = service_env({k: v for k, v in os.environ.items() if not k.startswith("OTEL_EXPORTER")
                       and k != "DDTREE_TRACE_FILE"} | {"PYTHONUNBUFFERED": "1"})
    port, metrics_port = free_port(), free_port()
    verify = Service("verify", ["--target", str(target), "--drafter", str(drafter), "--port", str(port),
                                "--device", "cpu", "--metrics-port", str(metrics_port)], env, "verify")
    front = Service("http", ["--verify", f"127.0.0.1:{port}", "--target", str(target), "--port", "0",
                             "--verify-metrics", f"http://127.0.0.1:{metrics_port}/metrics"], env, "http")
    try:
        verify.wait_ready()
        deadline = time.monotonic() + 60
        while not (m := re.search(r"^http listening on 127\.0\.0\.1:(\d+)$", front.log(), re.M)):
            assert time.monotonic() < deadline and front.proc.poll() is None, front.log()
            time.sleep(0.05)
        http_port = int(m.group(1))
        assert wait_until_http_ok(f"http://127.0.0.1:{http_port}/health", 30) == "", front.log()
        yield verify, http_port
    finally:
        front.stop()
        verify.stop()
    assert front.proc.returncode == 0 and "Traceback" not in front.log(), front.log()


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{stack[1]}/v1", api_key="unused", max_retries=0, timeout=60)


def grpc_generate(verify: Service, ids: list[int], mode: int, max_tokens: int):
    """Text and final usage of the gRPC API's greedy generation of `ids`."""
    with grpc.insecure_channel(f"127.0.0.1:{verify.port}") as channel:
        chunks = list(generation_pb2_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(max_tokens=max_tokens),
            speculation=pb.SpeculationParams(mode=mode)), timeout=60))
    return "".join(c.text for c in chunks), chunks[-1].usage


def scrape(port: int) -> dict:
    """{family name: family} of /metrics."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(families: dict, name: str, sample: str | None = None, **labels) -> float:
    for s in families[name].samples:
        if s.name == (sample or name) and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    return 0.0


def wait_line(service: Service, *needles: str, timeout: float = 10.0) -> bool:
    """Whether one line of the service's log soon contains every needle."""
    return bool(wait_until(lambda: any(all(n in line for n in needles) for line in list(service.lines)), timeout,
                           poll_s=0.05))


def post(port: int, path: str, body) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", path, body if isinstance(body, str) else json.dumps(body), {"content-type": "application/json"})
    response = conn.getresponse()
    return response.status, json.loads(response.read())


# ---- against the stack ---------------------------------------------------------------------------

def test_models_and_health(client, stack):
    assert [m.id for m in client.models.list().data] == ["target"]
    conn = http.client.HTTPConnection("127.0.0.1", stack[1], timeout=10)
    conn.request("GET", "/health")
    response = conn.getresponse()
    assert response.status == 200 and json.loads(response.read()) == {"status": "ok"}


@pytest.mark.parametrize("mode", ["ddtree", "chain", "ar"])
def test_greedy_completion_equals_the_grpc_api(client, stack, pair, mode):
    reply = client.completions.create(model="target", prompt=PROMPT, max_tokens=40, temperature=0,
                                      extra_body={"mode": mode})
    ids = prompt_ids(pair[0], PROMPT)  # BOS + the prompt: add_bos_token for the byte-level pair
    text, usage = grpc_generate(stack[0], ids, getattr(pb, f"MODE_{mode.upper()}"), 40)
    assert reply.choices[0].text == text and text
    assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == usage.completion_tokens
    assert reply.choices[0].finish_reason == ("length" if usage.finish_reason == pb.FINISH_REASON_LENGTH else "stop")
    assert reply.model_extra["speculation"]["mode"] == mode


def test_streamed_completion_equals_the_whole_one_and_ends_with_usage(client):
    args = dict(model="target", prompt=PROMPT, max_tokens=32, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**args)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 32
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 32
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "text_completion"


def test_chat_renders_the_built_in_template_and_streams_with_usage(client, stack, pair):
    args = dict(model="target", messages=CONVERSATION, max_tokens=24, temperature=0)
    whole = client.chat.completions.create(**args)
    expected_ids = [256] + list(b"# Helpers for text files.\n# Return the lines of a file.\n# Strip the newlines.\n")
    text, usage = grpc_generate(stack[0], expected_ids, pb.MODE_UNSPECIFIED, 24)
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].message.content == text
    assert whole.usage.prompt_tokens == len(expected_ids) and whole.object == "chat.completion"

    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == usage.completion_tokens
    assert chunks[-2].choices[0].finish_reason in ("length", "stop") and chunks[0].object == "chat.completion.chunk"
    without_usage = list(client.chat.completions.create(stream=True, **args))
    assert all(c.usage is None and c.choices for c in without_usage)


def test_stop_strings_are_left_out_streamed_or_not(client):
    base = client.completions.create(model="target", prompt=PROMPT, max_tokens=64, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base[20:23]
    expected = base[:base.index(stop)]
    for stops in (stop, [stop, "\x00never"]):
        args = dict(model="target", prompt=PROMPT, max_tokens=64, temperature=0, stop=stops,
                    extra_body={"ignore_eos": True})
        reply = client.completions.create(**args)
        assert reply.choices[0].text == expected and reply.choices[0].finish_reason == "stop"
        streamed = list(client.completions.create(stream=True, **args))
        assert "".join(c.choices[0].text for c in streamed) == expected
        assert streamed[-1].choices[0].finish_reason == "stop"


def test_max_tokens(client):
    reply = client.completions.create(model="target", prompt=PROMPT, max_tokens=5, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 5 and reply.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(model="target", messages=CONVERSATION, max_completion_tokens=3,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 3


@pytest.mark.parametrize("extra, param, message", [
    ({"n": 2}, "n", "n must be 1"),
    ({"logprobs": 2}, "logprobs", "logprobs is not supported"),
    ({"echo": True}, "echo", "echo is not supported"),
    ({"temperature": -1}, "temperature", "greater than or equal to 0"),
    ({"extra_body": {"speed": "fast"}}, "speed", "unrecognized request argument supplied: speed"),
    ({"extra_body": {"mode": "beam"}}, "mode", "'ddtree', 'chain' or 'ar'"),
    ({"max_tokens": 100000}, None, "max_tokens must be in 1..4096"),         # refused by the verify service
    ({"prompt": [1, 2, 999]}, None, "prompt token id 999 is outside the vocabulary"),
])
def test_bad_input_is_400_with_openai_error_body(client, extra, param, message):
    args = {"model": "target", "prompt": PROMPT, **extra}
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(**args)
    body = err.value.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert err.value.body == body["error"] and body["error"]["type"] == "invalid_request_error"
    assert message in body["error"]["message"] and body["error"]["param"] == param
    assert "Traceback" not in body["error"]["message"]


def test_bad_bodies_and_chat_input_are_400(client, stack):
    status, body = post(stack[1], "/v1/completions", '{"prompt": ')
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="target", messages=[])
    assert err.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="target", messages=CONVERSATION, logprobs=True)
    assert err.value.body["param"] == "logprobs"


def _raw_http(port: int, head: bytes, body_parts=()) -> tuple[int, dict]:
    """Sends a request byte by byte as given (the parts may stop short of the body the head
    announces) and reads the response: what http.client cannot do."""
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head)
        try:
            for part in body_parts:
                sock.sendall(part)
        except (BrokenPipeError, ConnectionResetError):  # refused and closed before the last part
            pass
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    head_text, _, body = reply.partition(b"\r\n\r\n")
    return int(head_text.split()[1]), json.loads(body)


def test_oversized_bodies_get_413_before_they_are_parsed(client, stack):
    """Past the largest legal body (a prompt of max_context x 32 characters as 12-byte JSON
    escapes, plus 1 MiB): 413 `request_too_large` naming the limit, never parsed (a Content-Length
    past twice the limit: answered before any of the body is sent; up to that, and chunked, the
    rest is read and dropped first, so a client still sending gets the answer, not a reset). A
    body of exactly the limit is served; token ids past the context are refused here, before
    they are sent to the verify service."""
    from ddtree.http.body_limit import max_body_bytes

    port = stack[1]
    limit = max_body_bytes(4096)

    def head(length: int) -> bytes:
        return (f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                f"content-length: {length}\r\n\r\n").encode()
    status, body = _raw_http(port, head(100 * limit))   # no body sent at all: refused on the header
    assert status == 413 and body["error"]["code"] == "request_too_large", body
    assert f"the request body is {100 * limit} bytes; this server takes at most {limit} bytes" in body["error"]["message"]
    assert "the context of 4096 tokens" in body["error"]["message"]
    status, body = _raw_http(port, head(limit + 1), [b" " * (limit + 1)])
    assert status == 413 and f"is {limit + 1} bytes" in body["error"]["message"], body

    chunked = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
               b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n")
    piece = b" " * (1 << 20)
    parts = [b"%x\r\n" % len(piece) + piece + b"\r\n"] * (limit // len(piece) + 1) + [b"0\r\n\r\n"]
    status, body = _raw_http(port, chunked, parts)
    assert status == 413 and f"has more than {limit} bytes" in body["error"]["message"], body

    small = json.dumps({"model": "target", "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "ignore_eos": True})
    at_limit = small[:-1] + " " * (limit - len(small)) + "}"   # JSON whitespace up to the limit
    assert len(at_limit.encode()) == limit
    status, body = post(port, "/v1/completions", at_limit)
    assert status == 200 and body["usage"]["completion_tokens"] == 3, body
    status, body = _raw_http(port, chunked, [b"%x\r\n%s\r\n0\r\n\r\n" % (len(small), small.encode())])
    assert status == 200 and body["usage"]["completion_tokens"] == 3, body   # chunked, within the limit

    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="target", prompt=[1] * 4096, max_tokens=2)
    assert err.value.body["param"] == "prompt"
    assert "the prompt has 4096 token ids; the context of 4096 tokens takes at most 4095" in err.value.body["message"]
    assert client.completions.create(model="target", prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2


def test_a_wrong_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4o", prompt=PROMPT, max_tokens=2)
    assert err.value.body["code"] == "model_not_found" and "'target'" in err.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=CONVERSATION)


def test_metrics_are_prometheus_text_and_move(client, stack):
    before = scrape(stack[1])
    reply = client.completions.create(model="target", prompt=PROMPT, max_tokens=24, temperature=0,
                                      extra_body={"ignore_eos": True, "mode": "ddtree"})
    after = scrape(stack[1])
    types = {"ddtree_http_requests": "counter", "ddtree_prompt_tokens": "counter", "ddtree_generation_tokens": "counter",
             "ddtree_requests_finished": "counter", "ddtree_running_requests": "gauge", "ddtree_verify_up": "gauge",
             "ddtree_time_to_first_token_seconds": "histogram", "ddtree_time_per_output_token_seconds": "histogram",
             "ddtree_inter_token_latency_seconds": "histogram", "ddtree_e2e_request_latency_seconds": "histogram",
             "ddtree_acceptance_length_tokens": "histogram", "ddtree_model_info": "gauge"}
    assert {name: after[name].type for name in types} == types

    def moved(name, sample=None, **labels):
        return value(after, name, sample, **labels) - value(before, name, sample, **labels)

    assert moved("ddtree_http_requests", "ddtree_http_requests_total", endpoint="/v1/completions", status="200") == 1
    assert moved("ddtree_generation_tokens", "ddtree_generation_tokens_total") == 24
    assert moved("ddtree_prompt_tokens", "ddtree_prompt_tokens_total") == reply.usage.prompt_tokens
    assert moved("ddtree_requests_finished", "ddtree_requests_finished_total", finish_reason="length") == 1
    for name in ("ddtree_time_to_first_token_seconds", "ddtree_time_per_output_token_seconds",
                 "ddtree_e2e_request_latency_seconds"):
        assert moved(name, f"{name}_count") == 1, name
    steps = reply.model_extra["speculation"]["steps"]
    assert moved("ddtree_acceptance_length_tokens", "ddtree_acceptance_length_tokens_count") == steps > 1
    assert moved("ddtree_acceptance_length_tokens", "ddtree_acceptance_length_tokens_sum") >= 24 - 1
    assert value(after, "ddtree_running_requests") == 0 and value(after, "ddtree_verify_up") == 1
    assert value(after, "ddtree_model_info", model="target") == 1


def test_verify_service_metrics_on_the_http_port_move(client, stack):
    """The verify service's own metrics (ddtree_verify_*), appended to the front's /metrics."""
    before = scrape(stack[1])
    reply = client.completions.create(model="target", prompt=PROMPT, max_tokens=24, temperature=0,
                                      extra_body={"ignore_eos": True, "mode": "ddtree"})
    after = scrape(stack[1])
    p = "ddtree_verify_"
    types = {p + "requests": "counter", p + "requests_rejected": "counter", p + "prompt_tokens": "counter",
             p + "generation_tokens": "counter", p + "degradation_events": "counter", p + "peer_reattaches": "counter",
             p + "time_to_first_token_seconds": "histogram", p + "time_per_output_token_seconds": "histogram",
             p + "inter_token_latency_seconds": "histogram", p + "e2e_request_latency_seconds": "histogram",
             p + "acceptance_length_tokens": "histogram", p + "step_seconds": "histogram",
             p + "step_component_seconds": "histogram", p + "step_batch_size": "histogram",
             p + "running_requests": "gauge", p + "queued_requests": "gauge", p + "kv_pages_reserved": "gauge",
             p + "kv_pages": "gauge", p + "metrics_up": "gauge"}
    assert {name: after[name].type for name in types} == types

    def moved(name, sample, **labels):
        return value(after, p + name, p + sample, **labels) - value(before, p + name, p + sample, **labels)

    steps = reply.model_extra["speculation"]["steps"]
    assert moved("requests", "requests_total", finish_reason="length", mode="ddtree") == 1
    assert moved("generation_tokens", "generation_tokens_total") == 24
    assert moved("prompt_tokens", "prompt_tokens_total") == reply.usage.prompt_tokens
    for name in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds"):
        assert moved(name, f"{name}_count") == 1, name
    assert moved("inter_token_latency_seconds", "inter_token_latency_seconds_count") == steps > 1
    assert moved("acceptance_length_tokens", "acceptance_length_tokens_count", mode="ddtree") == steps
    assert moved("acceptance_length_tokens", "acceptance_length_tokens_sum", mode="ddtree") >= 24 - 1
    assert moved("step_seconds", "step_seconds_count") == steps  # this request alone ran
    for component in ("draft", "tree_build", "verify", "accept", "commit"):
        assert moved("step_component_seconds", "step_component_seconds_count", component=component) == steps
        assert moved("step_component_seconds", "step_component_seconds_sum", component=component) > 0
    assert moved("step_component_seconds", "step_component_seconds_sum", component="verify") < \
        moved("step_seconds", "step_seconds_sum")
    assert value(after, p + "running_requests") == value(after, p + "queued_requests") == 0
    assert value(after, p + "kv_pages_reserved") == 0 and value(after, p + "kv_pages") == 2048  # --num-pages
    assert value(after, p + "metrics_up") == 1
    assert value(after, p + "degradation_events", p + "degradation_events_total") == 0


def test_a_client_that_disconnects_cancels_the_request(stack):
    verify, port = stack
    body = {"prompt": PROMPT, "max_tokens": 4000, "temperature": 0, "ignore_eos": True, "mode": "ar"}
    for stream in (True, False):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps(body | {"stream": stream}),
                     {"content-type": "application/json"})
        if stream:
            response = conn.getresponse()
            request_id = json.loads(response.readline()[6:])["id"]  # the first chunk has arrived
        else:
            time.sleep(0.5)
        conn.sock.close()
        conn.close()
        if stream:
            assert wait_line(verify, request_id, "finished: cancelled"), verify.log()
    deadline = time.monotonic() + 10
    while (value(metrics := scrape(port), "ddtree_requests_finished", "ddtree_requests_finished_total",
                 finish_reason="cancelled") < 2 or value(metrics, "ddtree_running_requests")):
        assert time.monotonic() < deadline, "the disconnected requests were not cancelled"
        time.sleep(0.1)
    assert value(metrics, "ddtree_http_requests", "ddtree_http_requests_total", endpoint="/v1/completions",
                 status="499") == 1  # the non-streamed one; the streamed one had sent its 200


# ---- without a server ----------------------------------------------------------------------------

CHATML = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_tokenizer_config_chat_template_renders_as_transformers_does(tmp_path):
    from transformers.utils.chat_template_utils import render_jinja_template

    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHATML, "bos_token": {"content": "<s>", "special": True}, "eos_token": "</s>",
        "added_tokens_decoder": {"256": {"content": "<s>"}, "257": {"content": "</s>"},
                                 "258": {"content": "<|im_start|>"}, "259": {"content": "<|im_end|>"}}}))
    prompts = Prompts.load(tmp_path, vocab_size=260, max_context=4096)
    rendered = prompts.render_chat(CONVERSATION)
    assert rendered == ("<s><|im_start|>system\nHelpers for text files.<|im_end|>\n<|im_start|>user\nReturn the lines "
                        "of a file.\nStrip the newlines.<|im_end|>\n<|im_start|>assistant\n")
    assert rendered == render_jinja_template([CONVERSATION], chat_template=CHATML, add_generation_prompt=True,
                                             bos_token="<s>", eos_token="</s>")[0][0]
    ids = prompts.chat(CONVERSATION)  # special-token names -> their ids, no BOS added on top of the template's
    assert ids[:2] == [256, 258] and ids[2:8] == list(b"system") and ids.count(259) == 2
    assert prompts.completion("hi") == [256, *b"hi"]  # byte-level: add_bos_token defaults to true

    (tmp_path / "chat_template.jinja").write_text("{{ messages[-1]['content'] }}")  # a saved file wins
    config = json.loads((tmp_path / "tokenizer_config.json").read_text()) | {"add_bos_token": False}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    prompts = Prompts.load(tmp_path, vocab_size=260, max_context=4096)
    assert prompts.render_chat(CONVERSATION) == CONVERSATION[-1]["content"]
    assert prompts.completion("hi") == list(b"hi") and prompts.completion([5, 6]) == [5, 6]


def test_the_built_in_template_of_the_byte_level_pair(pair):
    prompts = Prompts.load(pair[0], vocab_size=264, max_context=4096)
    assert prompts.chat_template == BYTE_LEVEL_TEMPLATE and prompts.config.add_bos_token
    conversation = CONVERSATION + [{"role": "assistant", "content": "def lines(path):"},
                                   {"role": "user", "content": "Now the words."}]
    assert prompts.render_chat(conversation) == ("<|bos|># Helpers for text files.\n# Return the lines of a file.\n"
                                                 "# Strip the newlines.\ndef lines(path):\n# Now the words.\n")
    assert prompts.chat(CONVERSATION[1:])[:3] == [256, *b"# "]
    assert ChatTemplate(BYTE_LEVEL_TEMPLATE).render([{"role": "user", "content": "x"}]) == "# x\n"


def test_tokenizer_config_without_template_or_bos(tmp_path):
    (tmp_path / "tokenizer.json").write_text(json.dumps({
        "version": "1.0", "added_tokens": [], "normalizer": None, "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": None, "decoder": None,
        "model": {"type": "WordLevel", "vocab": {"a": 0, "b": 1, "[UNK]": 2}, "unk_token": "[UNK]"}}))
    assert not TokenizerConfig.load(tmp_path, byte_level=False).add_bos_token
    prompts = Prompts.load(tmp_path, vocab_size=3, max_context=64)
    assert prompts.chat_template is None
    assert prompts.completion("a b") == [0, 1]
    with pytest.raises(APIError) as err:
        prompts.chat(CONVERSATION)
    assert err.value.status == 400 and "no chat template" in err.value.message


def test_stop_strings_are_held_back_across_chunks():
    trim = StopTrimmer(["END", "xyz"])
    assert [trim.push(t) for t in ("ab", "cE", "N", "D")] == ["ab", "c", "", ""]
    assert trim.finish(stopped_by_string=True) == ""
    trim = StopTrimmer(["END"])
    assert trim.push("aE") == "a" and trim.push("x") == "Ex" and trim.push("EN") == ""
    assert trim.finish(stopped_by_string=False) == "EN"  # length or EOS: the held text is the model's
    assert StopTrimmer([]).push("END") == "END"


@pytest.mark.parametrize("code, status", [
    (grpc.StatusCode.INVALID_ARGUMENT, 400), (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
    (grpc.StatusCode.UNAVAILABLE, 503), (grpc.StatusCode.DEADLINE_EXCEEDED, 504), (grpc.StatusCode.INTERNAL, 500),
])
def test_grpc_errors_map_to_http_statuses(code, status):
    error = from_grpc(grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="why"))
    assert error.status == status and error.body()["error"]["message"] == "why"


def test_a_message_past_the_verify_receive_limit_is_413_not_429():
    details = "SERVER: Received message larger than max (2000018 vs. 1327696)"
    error = from_grpc(grpc.aio.AioRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.Metadata(),
                                           grpc.aio.Metadata(), details=details))
    assert error.status == 413 and error.code == "request_too_large" and error.message == details
