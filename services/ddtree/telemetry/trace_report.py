"""`ddtree trace-report`: per-component latency attribution of decode steps from recorded traces.

Input: Jaeger's HTTP query API (`/api/traces`, the JSON its UI reads) or OTLP-JSON files (one
ExportTraceServiceRequest per line, as `OtlpJsonFileExporter` writes, or one JSON document).
Both are normalized to `SpanRecord`s; the attribution rules are in docs/observability.md.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

from ddtree.telemetry import spans as S

KINDS = ("gpu", "transport", "host")
OTHER = "other"                  # step wall not covered by any component span


@dataclass(frozen=True)
class SpanRecord:
    """One span, whatever the source format; times in ns since the epoch."""

    trace_id: str
    span_id: str
    parent_id: str               # "" for a root
    name: str
    kind: str                    # "internal", "server", "client", "producer", "consumer"
    start_ns: int
    end_ns: int
    service: str
    attributes: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


# ---- loading ----------------------------------------------------------------------------------
_OTLP_KINDS = {0: "unspecified", 1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}


def _otlp_value(value: dict) -> Any:
    if "stringValue" in value:
        return value["stringValue"]
    if "boolValue" in value:
        return bool(value["boolValue"])
    if "intValue" in value:
        return int(value["intValue"])          # a JSON string per the protobuf mapping
    if "doubleValue" in value:
        return float(value["doubleValue"])
    if "arrayValue" in value:
        return [_otlp_value(v) for v in value["arrayValue"].get("values", [])]
    if "kvlistValue" in value:
        return {kv["key"]: _otlp_value(kv.get("value", {})) for kv in value["kvlistValue"].get("values", [])}
    return None


def _otlp_kind(kind: Any) -> str:
    if isinstance(kind, str) and not kind.isdigit():
        return kind.removeprefix("SPAN_KIND_").lower()
    return _OTLP_KINDS.get(int(kind or 0), "unspecified")


def spans_from_otlp(document: dict) -> list[SpanRecord]:
    """Spans of one OTLP/JSON ExportTraceServiceRequest (or TracesData) document."""
    out = []
    for rs in document.get("resourceSpans", []):
        resource = {a["key"]: _otlp_value(a.get("value", {})) for a in rs.get("resource", {}).get("attributes", [])}
        service = str(resource.get("service.name", ""))
        for ss in rs.get("scopeSpans", []):
            for sp in ss.get("spans", []):
                out.append(SpanRecord(
                    trace_id=sp["traceId"].lower(), span_id=sp["spanId"].lower(),
                    parent_id=(sp.get("parentSpanId") or "").lower(), name=sp.get("name", ""),
                    kind=_otlp_kind(sp.get("kind", 0)), start_ns=int(sp["startTimeUnixNano"]),
                    end_ns=int(sp["endTimeUnixNano"]), service=service,
                    attributes={a["key"]: _otlp_value(a.get("value", {})) for a in sp.get("attributes", [])},
                ))
    return out


def load_otlp_file(path: str) -> list[SpanRecord]:
    """An OTLP-JSON file: JSON lines (our file exporter, the collector's file exporter) or one document."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        raise ValueError(f"cannot read trace file {path}: {exc.strerror}") from None
    try:
        documents = [json.loads(text)] if text.strip() else []
    except json.JSONDecodeError:
        documents = []
        for lineno, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    documents.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{lineno}: not OTLP-JSON: {exc.msg}") from None
    out = []
    for doc in documents:
        if not isinstance(doc, dict) or "resourceSpans" not in doc:
            raise ValueError(f"{path}: not OTLP-JSON (no resourceSpans)")
        out.extend(spans_from_otlp(doc))
    return out


def _jaeger_tag(tag: dict) -> Any:
    value, kind = tag.get("value"), tag.get("type", "string")
    if kind == "int64":
        return int(value)
    if kind == "float64":
        return float(value)
    if kind == "bool":
        return value if isinstance(value, bool) else str(value).lower() == "true"
    return value


def spans_from_jaeger(document: dict) -> list[SpanRecord]:
    """Spans of a Jaeger query-API response ({"data": [trace, ...]}); times there are in us."""
    if document.get("errors"):
        raise ValueError(f"Jaeger answered with errors: {document['errors']}")
    out = []
    for tr in document.get("data") or []:
        processes = tr.get("processes", {})
        for sp in tr.get("spans", []):
            tags = {t["key"]: _jaeger_tag(t) for t in sp.get("tags", [])}
            kind = str(tags.pop("span.kind", "internal")).lower()
            parent = next((r["spanID"] for r in sp.get("references", []) or []
                           if r.get("refType") == "CHILD_OF" and r.get("traceID") == sp["traceID"]), "")
            start_ns = int(sp["startTime"]) * 1000
            out.append(SpanRecord(
                trace_id=sp["traceID"].lower().rjust(32, "0"), span_id=sp["spanID"].lower(),
                parent_id=parent.lower(), name=sp.get("operationName", ""), kind=kind,
                start_ns=start_ns, end_ns=start_ns + int(sp.get("duration", 0)) * 1000,
                service=processes.get(sp.get("processID"), {}).get("serviceName", ""), attributes=tags,
            ))
    return out


_LOOKBACK = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_lookback(text: str) -> float:
    """"90s", "30m", "1h", "2d" -> seconds."""
    match = _LOOKBACK.match(text.strip())
    if not match:
        raise ValueError(f"lookback must look like 90s, 30m, 1h or 2d, got {text!r}")
    return float(match.group(1)) * _UNIT_S[match.group(2)]


def fetch_jaeger(url: str, service: str, lookback: str = "1h", limit: int = 1000,
                 timeout_s: float = 30.0) -> list[SpanRecord]:
    """Traces of `service` from the last `lookback` through Jaeger's /api/traces."""
    seconds = parse_lookback(lookback)
    end_us = int(time.time() * 1e6)
    query = urllib.parse.urlencode({"service": service, "start": end_us - int(seconds * 1e6), "end": end_us,
                                    "limit": limit, "lookback": lookback})
    address = f"{url.rstrip('/')}/api/traces?{query}"
    try:
        with urllib.request.urlopen(address, timeout=timeout_s) as reply:
            document = json.load(reply)
    except urllib.error.HTTPError as exc:
        raise ValueError(f"Jaeger at {url}: HTTP {exc.code} {exc.reason}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise ValueError(f"cannot reach Jaeger at {url}: {getattr(exc, 'reason', exc)}") from None
    except json.JSONDecodeError:
        raise ValueError(f"Jaeger at {url} did not answer JSON (is this the query port, 16686?)") from None
    return spans_from_jaeger(document)


# ---- attribution ------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepBreakdown:
    """One step: its wall time, and per component (wall, gpu, transport, host) in ms."""

    trace_id: str
    span_id: str
    group: str
    wall_ms: float
    components: dict[str, dict[str, float]]   # component -> {"wall", "gpu", "transport", "host", "count"}

    @property
    def other_ms(self) -> float:
        return self.wall_ms - sum(c["wall"] for c in self.components.values())


def _descendants(span: SpanRecord, children: dict) -> Iterable[SpanRecord]:
    stack = list(children.get((span.trace_id, span.span_id), ()))
    while stack:
        sp = stack.pop()
        yield sp
        stack.extend(children.get((sp.trace_id, sp.span_id), ()))


def _attribute(span: SpanRecord, children: dict) -> dict[str, float]:
    """wall / gpu / transport / host of one component span (rules in docs/observability.md)."""
    wall = span.duration_ms
    below = list(_descendants(span, children))
    # GPU: the event-timed spans; without them, the gpu_ms the servers put on their spans; else
    # the ServerTiming.gpu_ms the caller copied onto the component span.
    gpu_spans = [sp.duration_ms for sp in below if sp.attributes.get(S.GPU) is True]
    server_gpu = [float(sp.attributes[S.SERVER_GPU_MS]) for sp in below if S.SERVER_GPU_MS in sp.attributes]
    gpu = sum(gpu_spans) if gpu_spans else sum(server_gpu) if server_gpu else float(span.attributes.get(S.SERVER_GPU_MS, 0.0))
    transport = 0.0
    clients = [sp for sp in below if sp.kind == "client"]
    unmatched = 0.0
    for client in clients:
        servers = [c for c in children.get((client.trace_id, client.span_id), ()) if c.kind == "server"]
        if servers:
            transport += max(0.0, client.duration_ms - sum(s.duration_ms for s in servers))
        else:
            unmatched += client.duration_ms
    if unmatched and S.SERVER_MS in span.attributes:
        transport += max(0.0, unmatched - float(span.attributes[S.SERVER_MS]))
    return {"wall": wall, "gpu": gpu, "transport": transport, "host": max(0.0, wall - gpu - transport)}


_SUMMARY_WALL = re.compile(r"^ddtree\.(\w+)\.wall_ms$")


def _summary_components(step: SpanRecord) -> dict[str, dict[str, float]]:
    """Components of a DDTREE_TRACE_DETAIL=summary step, from its attributes: gpu from the
    events (else the servers' gpu_ms), transport = wall - server_ms (this includes the caller's
    own work around the RPC, which span mode counts as host)."""
    comps = {}
    for key, value in step.attributes.items():
        match = _SUMMARY_WALL.match(key)
        if not match:
            continue
        name = match.group(1)
        get = lambda field: float(step.attributes.get(S.summary_key(name, field), 0.0))  # noqa: E731
        wall = float(value)
        gpu = get("gpu_ms") or get("server_gpu_ms")
        has_server = S.summary_key(name, "server_ms") in step.attributes
        transport = max(0.0, wall - get("server_ms")) if has_server else 0.0
        comps[name] = {"wall": wall, "gpu": gpu, "transport": transport,
                       "host": max(0.0, wall - gpu - transport), "count": int(get("count"))}
    return comps


# Step grouping keys: a step attribute, or "level": the tag of the step's parent request (its
# ddtree.request.id without a trailing "-<n>", e.g. "loadtest-ddtree-c4" for the load test's
# requests), which separates the levels of a load-test sweep whatever batch sizes they made.
GROUP_KEYS = {"batch_size": S.STEP_BATCH_SIZE, "mode": S.STEP_MODE, "budget": S.STEP_BUDGET, "level": "level"}


def _group_of(step: SpanRecord, group_by: Sequence[str], unique: dict) -> str:
    parts = []
    for name in group_by:
        if name == "level":
            parent = unique.get((step.trace_id, step.parent_id))
            tag = parent.attributes.get(S.REQUEST_ID, "") if parent is not None and parent.name == S.REQUEST else ""
            parts.append(re.sub(r"-\d+$", "", str(tag)) or "?")
        else:
            parts.append(str(step.attributes.get(GROUP_KEYS[name], "?")))
    return "/".join(parts) or "all"


def step_breakdowns(spans: Sequence[SpanRecord], group_by: Sequence[str] = ("batch_size",)) -> list[StepBreakdown]:
    """Every ddtree.step span with its components attributed, in start order.

    `group_by`: names from GROUP_KEYS; the step's group is their values joined by "/".
    """
    unknown = [g for g in group_by if g not in GROUP_KEYS]
    if unknown:
        raise ValueError(f"unknown group key {unknown[0]!r}; expected some of {', '.join(GROUP_KEYS)}")
    children: dict[tuple[str, str], list[SpanRecord]] = defaultdict(list)
    unique = {(sp.trace_id, sp.span_id): sp for sp in spans}   # a span exported twice counts once
    for sp in unique.values():
        if sp.parent_id:
            children[(sp.trace_id, sp.parent_id)].append(sp)
    out = []
    for step in sorted((sp for sp in unique.values() if sp.name == S.STEP), key=lambda s: s.start_ns):
        comps: dict[str, dict[str, float]] = {}
        for child in children.get((step.trace_id, step.span_id), ()):
            name = child.attributes.get(S.COMPONENT)
            if not name or child.attributes.get(S.GPU) is True:
                continue
            acc = comps.setdefault(name, {"wall": 0.0, "gpu": 0.0, "transport": 0.0, "host": 0.0, "count": 0})
            for key, value in _attribute(child, children).items():
                acc[key] += value
            acc["count"] += 1
        if not comps:
            comps = _summary_components(step)
        group = _group_of(step, group_by, unique)
        out.append(StepBreakdown(step.trace_id, step.span_id, group, step.duration_ms, comps))
    return out


@dataclass(frozen=True)
class ComponentRow:
    component: str
    count: int             # spans
    steps: int             # steps it appeared in
    mean_ms: float         # per step where it appeared
    p50_ms: float
    p90_ms: float
    share: float           # of the total step wall time of the group
    gpu_ms: float          # means per step where it appeared
    transport_ms: float
    host_ms: float


@dataclass(frozen=True)
class GroupReport:
    group: str
    steps: int
    step_mean_ms: float
    step_p50_ms: float
    step_p90_ms: float
    rows: list[ComponentRow]


def _pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else math.nan


def _group_key(group: str):
    """Natural order: "c4" before "c10", "ddtree/4" before "ddtree/10"."""
    return [(int(t), "") if t.isdigit() else (-1, t) for t in re.split(r"(\d+)", group)]


def summarize(steps: Sequence[StepBreakdown], with_all: bool = True) -> list[GroupReport]:
    """Per group (and "all" when there is more than one group): one row per component + other."""
    groups: dict[str, list[StepBreakdown]] = defaultdict(list)
    for st in steps:
        groups[st.group].append(st)
    names = sorted(groups, key=_group_key)
    if with_all and len(names) > 1:
        groups["all"] = list(steps)
        names.append("all")
    reports = []
    for name in names:
        members = groups[name]
        total_wall = sum(st.wall_ms for st in members)
        order = [c for c in S.COMPONENTS if any(c in st.components for st in members)]
        order += sorted({c for st in members for c in st.components} - set(order))
        rows = []
        for comp in order:
            present = [st.components[comp] for st in members if comp in st.components]
            walls = [c["wall"] for c in present]
            rows.append(ComponentRow(
                comp, int(sum(c["count"] for c in present)), len(present), sum(walls) / len(walls),
                _pct(walls, 50), _pct(walls, 90), sum(walls) / total_wall if total_wall else math.nan,
                *(sum(c[k] for c in present) / len(present) for k in KINDS)))
        others = [st.other_ms for st in members]
        rows.append(ComponentRow(OTHER, len(members), len(members), sum(others) / len(others),
                                 _pct(others, 50), _pct(others, 90),
                                 sum(others) / total_wall if total_wall else math.nan, 0.0, 0.0, sum(others) / len(others)))
        walls = [st.wall_ms for st in members]
        reports.append(GroupReport(name, len(members), sum(walls) / len(walls), _pct(walls, 50), _pct(walls, 90), rows))
    return reports


# ---- output -----------------------------------------------------------------------------------
def format_table(reports: Sequence[GroupReport], group_by: Sequence[str] = ("batch_size",)) -> str:
    label = "/".join(group_by)
    lines = []
    header = (f"{'component':<12}{'count':>7}{'mean_ms':>10}{'p50_ms':>10}{'p90_ms':>10}{'share':>8}"
              f"{'gpu_ms':>10}{'transport_ms':>14}{'host_ms':>10}")
    for rep in reports:
        title = "all steps" if rep.group == "all" else f"{label}={rep.group}"
        lines.append(f"{title}: {rep.steps} steps, step ms mean {rep.step_mean_ms:.3f} "
                     f"p50 {rep.step_p50_ms:.3f} p90 {rep.step_p90_ms:.3f}")
        lines.append(header)
        for r in rep.rows:
            lines.append(f"{r.component:<12}{r.count:>7}{r.mean_ms:>10.3f}{r.p50_ms:>10.3f}{r.p90_ms:>10.3f}"
                         f"{r.share * 100:>7.1f}%{r.gpu_ms:>10.3f}{r.transport_ms:>14.3f}{r.host_ms:>10.3f}")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def to_json(reports: Sequence[GroupReport], group_by: Sequence[str]) -> str:
    return json.dumps({"group_by": list(group_by), "groups": [asdict(r) for r in reports]}, indent=1)


def _pyplot():
    """matplotlib is optional: imported only for --plot, with a clear error when missing."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(reports: Sequence[GroupReport], path: str, group_by: Sequence[str]) -> None:
    """PNG: mean ms per step stacked by component (left) and by gpu/transport/host (right)."""
    plt = _pyplot()
    reports = [r for r in reports if r.group != "all"] or list(reports)
    labels = [r.group for r in reports]
    comps = list(dict.fromkeys(row.component for r in reports for row in r.rows))
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    bottom = [0.0] * len(reports)
    for comp in comps:
        # A component's mean per step over ALL steps of the group, so the stack sums to the step.
        heights = [next((row.mean_ms * row.steps / r.steps for row in r.rows if row.component == comp), 0.0)
                   for r in reports]
        left.bar(labels, heights, bottom=bottom, label=comp)
        bottom = [b + h for b, h in zip(bottom, heights)]
    left.set_title("step time by component")
    bottom = [0.0] * len(reports)
    for kind in KINDS:
        heights = [sum(getattr(row, f"{kind}_ms") * row.steps / r.steps for row in r.rows) for r in reports]
        right.bar(labels, heights, bottom=bottom, label=kind)
        bottom = [b + h for b, h in zip(bottom, heights)]
    right.set_title("step time by kind")
    for ax in (left, right):
        ax.set_xlabel("/".join(group_by) or "all steps")
        ax.tick_params(axis="x", labelrotation=30 if len(reports) > 6 else 0)
        ax.set_ylabel("mean ms per step")
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- command ----------------------------------------------------------------------------------
def add_trace_report_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "trace-report", help="per-component step latency from traces (Jaeger or OTLP-JSON file)",
        description="Attributes decode-step time to draft / tree_build / verify / accept / commit "
                    "(mean, p50, p90 ms per step, share of the step, GPU vs transport vs host), "
                    "grouped by batch size. Reads Jaeger's query API or OTLP-JSON files.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--jaeger", metavar="URL", help="Jaeger query base URL, e.g. http://127.0.0.1:16686")
    src.add_argument("--file", metavar="PATH", action="append",
                     help="OTLP-JSON(-lines) file, e.g. a DDTREE_TRACE_FILE (repeatable)")
    p.add_argument("--service", default="ddtree-verify", help="Jaeger service to search (default ddtree-verify)")
    p.add_argument("--lookback", default="1h", help="Jaeger time window: 90s, 30m, 1h, 2d (default 1h)")
    p.add_argument("--limit", type=int, default=1000, help="most traces to fetch from Jaeger (default 1000)")
    p.add_argument("--group-by", default="batch_size", metavar="KEYS",
                   help="comma-separated grouping of steps, from batch_size, mode, budget, level (the load "
                        "test's level, from the request id), or none (default batch_size)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--plot", metavar="PNG", help="also write a stacked-bar chart (needs matplotlib)")
    p.set_defaults(func=run_trace_report)
    return p


def run_trace_report(args: argparse.Namespace) -> int:
    group_by = tuple(g for g in (x.strip() for x in args.group_by.split(",")) if g and g != "none")
    try:
        if args.plot:
            _pyplot()                 # fail before any output when it cannot be drawn
        if args.jaeger:
            records = fetch_jaeger(args.jaeger, args.service, args.lookback, args.limit)
            source = f"Jaeger {args.jaeger} service {args.service} (last {args.lookback})"
        else:
            records = [sp for path in args.file for sp in load_otlp_file(path)]
            source = ", ".join(args.file)
        steps = step_breakdowns(records, group_by)
        if not steps:
            print(f"trace-report: no {S.STEP} spans in {source} ({len(records)} spans read)", file=sys.stderr)
            return 1
        reports = summarize(steps, with_all=bool(group_by))
        print(to_json(reports, group_by) if args.json else format_table(reports, group_by), end="" if not args.json else "\n")
        if args.plot:
            plot(reports, args.plot, group_by)
    except ValueError as exc:
        print(f"trace-report: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (python -m ddtree.telemetry.trace_report) until `ddtree` registers it."""
    parser = argparse.ArgumentParser(prog="ddtree")
    add_trace_report_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
