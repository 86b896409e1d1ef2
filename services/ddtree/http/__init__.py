"""The OpenAI-compatible HTTP API: a thin front over the verify service's gRPC Generation API.

`ddtree serve http --verify HOST:PORT --target DIR` (main.py) serves /v1/completions,
/v1/chat/completions (SSE streaming), /v1/models, /health and Prometheus /metrics; the contract
and its decisions are in docs/http.md.
"""
