"""One process's transport: the regions it produces, the regions it imported from each peer,
attachment bookkeeping (reference counts, deferred release, dead-peer reaping) and the
start-up self-test that picks the region kind."""
from __future__ import annotations

import hmac
import logging
import os
import threading
from dataclasses import dataclass, field

import torch
from opentelemetry import trace

from ddtree.transport import fastpath, selftest
from ddtree.transport.errors import (AttachDenied, BadRegionHandle, BadTensorRef, TransportUnavailable, Unauthenticated,
                                     UnknownPeer)
from ddtree.transport.host import host_id, pid_alive
from ddtree.transport.memory import SHM_DIR, SHM_PREFIX, shm_owner_pid, unlink_segment
from ddtree.transport.region import (INLINE, KIND_OF_NAME, SHM, VIEW_CACHE_MAX, ImportedRegion, Region, View,
                                     kind_name)
from ddtree.v1 import tensor_pb2, transport_pb2

log = logging.getLogger(__name__)
_tracer = trace.get_tracer("ddtree.transport")

TOKEN_ENV = "DDTREE_TRANSPORT_TOKEN"
PROBE_REGION = "transport/probe"
MIN_PEER_SECRET, MAX_PEER_SECRET = 32, 256   # characters of AttachRequest.peer_secret


@dataclass(frozen=True)
class TransportConfig:
    """How this process shares tensors. Env: DDTREE_TRANSPORT_KIND, DDTREE_TRANSPORT_FALLBACK."""

    peer_id: str                        # stable identity, e.g. "drafter-1234"; peers namespace our regions by it
    kind: str = "auto"                  # auto (cuda_ipc on a GPU device, else shm) | cuda_ipc | shm | inline
    device: str = "cpu"                 # where our regions live ("cuda:0" for cuda_ipc)
    fallback: tuple[str, ...] = ()      # kinds allowed, in order, if `kind` fails its self-test; () = fail loudly
    token: str | None = None            # shared secret for Attach/Detach/Status; None = env DDTREE_TRANSPORT_TOKEN
    self_test: bool = True              # prove the chosen kind with a round trip through a child process
    probe_slot_bytes: int = 1 << 16     # slot size of the probe region (self-tests and Probe echoes)
    reap_interval_s: float = 1.0        # how often dead peers are looked for (0 = only on demand)

    @classmethod
    def from_env(cls, peer_id: str, device: str = "cpu", **overrides) -> "TransportConfig":
        fallback = tuple(k for k in os.environ.get("DDTREE_TRANSPORT_FALLBACK", "").split(",") if k)
        return cls(peer_id=peer_id, device=device, kind=os.environ.get("DDTREE_TRANSPORT_KIND", "auto"),
                   fallback=fallback, **overrides)


@dataclass
class _Peer:
    peer_id: str
    pid: int                             # producer pid to watch for death (0: not visible, not watched)
    inline: bool                         # our outputs reach it inline (another host or cannot map our kind)
    regions: dict[str, ImportedRegion] = field(default_factory=dict)
    secret: bytes = b""                  # its AttachRequest.peer_secret; b"": no call can authenticate as it
    holds: int = 0                       # in-flight uses (PeerScope) keeping its regions mapped
    detached: bool = False
    # serialized TensorRef (names its region) -> validated View, across the peer's regions: a known
    # descriptor is one dict lookup, no region lookup. Only when no region is inline (their refs
    # carry bytes); emptied when the regions are released; cleared when full.
    views: dict = field(default_factory=dict)
    zero_copy: bool = False

    def __post_init__(self) -> None:
        self.zero_copy = all(r.kind != INLINE for r in self.regions.values())


def _view(peer: _Peer, ref: tensor_pb2.TensorRef) -> View | None:
    """The validated View of `ref` (no stream wait); None for a ref into an inline region."""
    if peer.zero_copy:
        key = ref.SerializePartialToString()
        view = peer.views.get(key)
        if view is not None:
            return view
    region = peer.regions.get(ref.region)
    if region is None:
        raise BadTensorRef(f"unknown region {ref.region!r} of peer {peer.peer_id!r}")
    view = region.view(ref)   # validated (first sight) or the region's cached View
    if view is not None and peer.zero_copy:
        views = peer.views
        if len(views) >= VIEW_CACHE_MAX:
            views.clear()
        views[key] = view
    return view


def _resolve(peer: _Peer, ref: tensor_pb2.TensorRef) -> torch.Tensor:
    view = _view(peer, ref)
    if view is None:   # inline: decoded (one copy) onto our device
        return peer.regions[ref.region].resolve(ref)
    if view.event is not None:
        fastpath.wait(view.event, view.event_ptr, view.device_index)
    return view.tensor


class PeerScope:
    """A peer's regions held for one RPC (`with transport.hold(peer_id) as scope`): a Detach
    meanwhile is deferred until the scope ends. A plain class, not a generator: it is on the
    per-step path."""

    __slots__ = ("_transport", "peer", "peer_id")

    def __init__(self, transport: "Transport", peer: _Peer):
        self._transport, self.peer, self.peer_id = transport, peer, peer.peer_id

    def __enter__(self) -> "PeerScope":
        return self

    def __exit__(self, *exc) -> None:
        self._transport._unhold(self.peer)

    def resolve(self, ref: tensor_pb2.TensorRef) -> torch.Tensor:
        return _resolve(self.peer, ref)

    def view(self, ref: tensor_pb2.TensorRef) -> View | None:
        """The validated, cached `View` of `ref` without the stream wait (None for an inline
        region): for consumers that order their reads themselves (`view.wait()` or a native read
        on `view.event_ptr`), e.g. the probe's deferred read."""
        return _view(self.peer, ref)

    def for_peer(self, ref: tensor_pb2.TensorRef) -> tensor_pb2.TensorRef:
        return self._transport.for_peer(self.peer_id, ref)


class Transport:
    """Regions we produce + regions imported per peer. Thread-safe; close() (or `with`) at shutdown."""

    def __init__(self, config: TransportConfig):
        if not config.peer_id:
            raise ValueError("TransportConfig.peer_id must be set")
        self.config = config
        self.peer_id = config.peer_id
        self.device = torch.device(config.device)
        self.token = config.token if config.token is not None else os.environ.get(TOKEN_ENV, "")
        self._lock = threading.RLock()
        self._regions: dict[str, Region] = {}
        self._peers: dict[str, _Peer] = {}
        self._lingering: list[tuple[str, ImportedRegion]] = []   # released but still mapped by live views
        self._closed = False
        sweep_stale_segments()
        self.kind, self.fallback_reason = self._choose_kind()
        region_device = self.device if self.kind != SHM else torch.device("cpu")
        self.probe = self.create_region(PROBE_REGION, slot_count=4, slot_bytes=config.probe_slot_bytes,
                                        device=region_device)
        self._stop = threading.Event()
        self._reaper = None
        if config.reap_interval_s > 0:
            self._reaper = threading.Thread(target=self._reap_loop, name="transport-reaper", daemon=True)
            self._reaper.start()

    # --- kind selection (self-test) -------------------------------------------------------
    def _choose_kind(self) -> tuple[int, str]:
        requested = self.config.kind
        if requested == "auto":
            requested = "cuda_ipc" if self.device.type == "cuda" else "shm"
        candidates = [requested, *[k for k in self.config.fallback if k != requested]]
        for name in candidates:
            if name not in KIND_OF_NAME:
                raise ValueError(f"unknown transport kind {name!r}; choose from {sorted(KIND_OF_NAME)} or auto")
        failures = []
        with _tracer.start_as_current_span("transport.self_test") as span:
            span.set_attribute("ddtree.transport.requested_kind", requested)
            for name in candidates:
                kind = KIND_OF_NAME[name]
                device = torch.device("cpu") if kind == SHM else self.device
                try:
                    if self.config.self_test:
                        selftest.round_trip(kind, device)
                except Exception as exc:  # noqa: BLE001 - every failure is reported below
                    failures.append(f"{name}: {exc}")
                    log.error("transport self-test of %s failed: %s", name, exc)
                    continue
                reason = "" if name == requested else f"{requested} unavailable ({failures[0]}); fell back to {name}"
                span.set_attribute("ddtree.transport.kind", name)
                span.set_attribute("ddtree.transport.self_tested", self.config.self_test)
                if reason:
                    span.set_attribute("ddtree.transport.fallback_reason", reason)
                    log.warning("transport: %s", reason, extra={"transport_kind": name, "fallback_reason": reason})
                else:
                    log.info("transport: %s path %s", name, "proven by a round trip" if self.config.self_test
                             else "chosen without self-test", extra={"transport_kind": name})
                return kind, reason
            span.set_attribute("ddtree.transport.failure", "; ".join(failures))
        raise TransportUnavailable(
            f"no usable transport: {'; '.join(failures)}. Allow a fallback with DDTREE_TRANSPORT_FALLBACK=shm,inline "
            f"(or TransportConfig.fallback) if slower hand-offs are acceptable")

    # --- our regions ----------------------------------------------------------------------
    def create_region(self, name: str, slot_count: int, slot_bytes: int,
                      device: torch.device | str | None = None) -> Region:
        """A ring of slots of this transport's kind; create them all before peers attach."""
        with self._lock:
            if name in self._regions:
                raise ValueError(f"region {name!r} already exists")
            dev = torch.device(device) if device is not None else (
                torch.device("cpu") if self.kind == SHM else self.device)
            region = Region(name, self.kind, slot_count, slot_bytes, dev)
            self._regions[name] = region
            return region

    def region(self, name: str) -> Region:
        return self._regions[name]

    def handles(self, inline: bool = False) -> list[tensor_pb2.RegionHandle]:
        with self._lock:
            return [r.handle(inline=inline) for r in self._regions.values()]

    # --- attachment -----------------------------------------------------------------------
    def check_token(self, token: str) -> None:
        """Raises AttachDenied unless `token` is ours (always passes when we have none)."""
        if self.token and not hmac.compare_digest(token.encode(), self.token.encode()):
            raise AttachDenied(f"wrong or missing transport token ({TOKEN_ENV})")

    def attach(self, request: transport_pb2.AttachRequest) -> transport_pb2.AttachReply:
        """Server side of Attach: checks token, peer secret and host, imports the peer's regions
        (replacing a previous attachment of the same peer id) and returns ours. Raises TransportError."""
        self.check_token(request.token)
        if not request.peer_id:
            raise BadRegionHandle("AttachRequest.peer_id is empty")
        secret = request.peer_secret
        if not (MIN_PEER_SECRET <= len(secret) <= MAX_PEER_SECRET and secret.isascii() and secret.isprintable()):
            raise BadRegionHandle(f"AttachRequest.peer_secret must be {MIN_PEER_SECRET}..{MAX_PEER_SECRET} printable "
                                  f"ASCII characters (PeerLink makes one), got {len(secret)}")
        same_host = request.host_id == host_id()
        accepts_ours = not request.accepted_kinds or self.kind in request.accepted_kinds
        inline = not same_host or not accepts_ours
        reason = self.fallback_reason
        if inline and self.kind != INLINE:
            why = "it is on another host" if not same_host else f"it does not accept {kind_name(self.kind)}"
            reason = f"outputs sent inline to {request.peer_id!r}: {why}"
            log.warning("transport: %s", reason, extra={"peer": request.peer_id})
        self.import_peer(request.peer_id, request.regions, inline=inline, peer_host=request.host_id, secret=secret)
        span = trace.get_current_span()
        span.set_attribute("ddtree.transport.peer", request.peer_id)
        span.set_attribute("ddtree.transport.kind", kind_name(INLINE if inline else self.kind))
        if reason:
            span.set_attribute("ddtree.transport.fallback_reason", reason)
        return transport_pb2.AttachReply(peer_id=self.peer_id, regions=self.handles(inline=inline),
                                         kind=INLINE if inline else self.kind, fallback_reason=reason)

    def import_peer(self, peer_id: str, handles, inline: bool = False, peer_host: str | None = None,
                    secret: str = "") -> None:
        """Maps every region a peer exports (once), namespaced by its peer id. `inline`: our
        outputs reach this peer inline. `peer_host`: the host the peer says it runs on. `secret`:
        what its calls must carry to be served as it (`hold(peer_id, secret)`)."""
        mine = host_id()
        imported: dict[str, ImportedRegion] = {}
        pid = 0
        try:
            for h in handles:
                foreign = h.host_id if h.host_id != mine else peer_host if peer_host not in (None, mine) else None
                if h.kind != INLINE and foreign is not None:
                    raise BadRegionHandle(
                        f"region {h.name!r} of peer {peer_id!r} is a {kind_name(h.kind)} handle from host "
                        f"{foreign!r}, this is {mine!r}: handles from another host are refused (attach inline)")
                if h.name in imported:
                    raise BadRegionHandle(f"peer {peer_id!r} exports region {h.name!r} twice")
                imported[h.name] = ImportedRegion(peer_id, h, self.device)
                if h.kind != INLINE and h.producer_pid and pid_alive(h.producer_pid):
                    pid = h.producer_pid   # same host and visible: watch it to reap the peer if it dies
        except BaseException:
            for r in imported.values():
                r.release()
            raise
        with self._lock:
            old = self._peers.get(peer_id)
            self._peers[peer_id] = _Peer(peer_id, pid, inline, imported, secret=secret.encode())
            if old is not None:
                self._drop(old)
        log.info("transport: attached peer %s (%d regions%s)", peer_id, len(imported), ", inline" if inline else "",
                 extra={"peer": peer_id})

    def detach(self, peer_id: str, token: str | None = None, secret: str | None = None) -> bool:
        """Forgets a peer; its regions are unmapped once no RPC holds them. False if unknown.
        The Detach RPC passes the call's `token` and peer `secret` (checked); in-process callers
        (reaper, close) pass neither."""
        if token is not None:
            self.check_token(token)
        with self._lock:
            peer = self._peers.get(peer_id)
            if peer is None:
                return False
            if secret is not None:
                _authenticate(peer, secret)
            del self._peers[peer_id]
            self._drop(peer)
        log.info("transport: detached peer %s", peer_id, extra={"peer": peer_id})
        return True

    def _drop(self, peer: _Peer) -> None:
        peer.detached = True
        if peer.holds == 0:
            peer.views = {}
            for r in peer.regions.values():
                r.release()
                if r.memory is not None and r.memory.alive():
                    self._lingering.append((peer.peer_id, r))

    def peers(self) -> list[str]:
        with self._lock:
            return sorted(self._peers)

    # --- per-step use -----------------------------------------------------------------------
    def _peer(self, peer_id: str) -> _Peer:
        peer = self._peers.get(peer_id)
        if peer is None:
            raise UnknownPeer(f"peer {peer_id!r} is not attached (Attach first)")
        return peer

    def hold(self, peer_id: str, secret: str | None = None) -> "PeerScope":
        """Holds a peer's regions for one RPC (ref counts +1; a Detach meanwhile is deferred);
        use as `with transport.hold(peer_id) as scope: scope.resolve(ref)`. `secret`: the call's
        peer secret, which must be the one the peer attached with (serve_peer passes what the
        metadata carries, "" when none: Unauthenticated); None only for in-process callers."""
        with self._lock:
            peer = self._peer(peer_id)
            if secret is not None:
                _authenticate(peer, secret)
            peer.holds += 1
        return PeerScope(self, peer)

    def _unhold(self, peer: _Peer) -> None:
        with self._lock:
            peer.holds -= 1
            if peer.detached and peer.holds == 0:
                self._drop(peer)

    def resolve(self, peer_id: str, ref: tensor_pb2.TensorRef) -> torch.Tensor:
        """The tensor a peer's TensorRef names (validated; cuda_ipc: ordered after the producer's
        writes on the current stream). Raises BadTensorRef / UnknownPeer (-> INVALID_ARGUMENT...)."""
        return _resolve(self._peer(peer_id), ref)

    def for_peer(self, peer_id: str, ref: tensor_pb2.TensorRef) -> tensor_pb2.TensorRef:
        """A ref into one of our regions, made fit for `peer_id`: unchanged for zero-copy peers,
        with its bytes attached for inline peers (this synchronizes with the current stream)."""
        peer = self._peer(peer_id)
        if not peer.inline or ref.inline_data:
            return ref
        region = self._regions.get(ref.region)
        if region is None:
            raise ValueError(f"{ref.region!r} is not a region of this process")
        return region.inline_ref(ref)

    # --- bookkeeping ----------------------------------------------------------------------
    def status(self, token: str | None = None) -> transport_pb2.TransportStatusReply:
        """Regions (own and imported) with reference counts, and attached peers. The Status RPC
        passes the request's `token` (checked)."""
        if token is not None:
            self.check_token(token)
        self.reap_dead_peers()
        with self._lock:
            self._lingering = [(p, r) for p, r in self._lingering if r.memory is not None and r.memory.alive()]
            peers = list(self._peers.values())
            attached = len(peers)
            holds = sum(p.holds for p in peers)
            reply = transport_pb2.TransportStatusReply(peers=sorted(self._peers))
            for r in self._regions.values():
                reply.regions.add(name=r.name, kind=r.kind, owned=True, ref_count=attached + holds,
                                  byte_size=r.byte_size, slot_count=r.slot_count)
            for p in peers:
                for r in p.regions.values():
                    reply.regions.add(name=f"{p.peer_id}/{r.name}", kind=r.kind, owned=False,
                                      ref_count=1 + p.holds, byte_size=r.byte_size, slot_count=r.slot_count)
            for peer_id, r in self._lingering:
                reply.regions.add(name=f"{peer_id}/{r.name}", kind=r.kind, owned=False, ref_count=0,
                                  pending_release=True, byte_size=r.byte_size, slot_count=r.slot_count)
            return reply

    def reap_dead_peers(self) -> list[str]:
        """Detaches peers whose process died (their shm memory goes with our last view of it)."""
        with self._lock:
            dead = [p for p in self._peers.values() if p.pid and not pid_alive(p.pid)]
        for peer in dead:
            log.warning("transport: peer %s (pid %d) died; detaching it", peer.peer_id, peer.pid,
                        extra={"peer": peer.peer_id})
            self.detach(peer.peer_id)
        return [p.peer_id for p in dead]

    def _reap_loop(self) -> None:
        while not self._stop.wait(self.config.reap_interval_s):
            try:
                self.reap_dead_peers()
            except Exception:  # noqa: BLE001 - the reaper must never die
                log.exception("transport reaper failed")

    def close(self) -> None:
        """Detaches every peer, unlinks our shm segments, frees our regions (after their last view)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        with self._lock:
            for peer_id in list(self._peers):
                self.detach(peer_id)
            for r in self._regions.values():
                r.close()
            self._regions.clear()

    def __enter__(self) -> "Transport":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _authenticate(peer: _Peer, secret: str) -> None:
    """Raises Unauthenticated unless `secret` is the one `peer` attached with (constant time)."""
    if not (peer.secret and hmac.compare_digest(secret.encode(), peer.secret)):
        raise Unauthenticated(f"call for peer {peer.peer_id!r} without its peer secret "
                              f"({'a wrong one' if secret else 'none'} in ddtree-peer-secret metadata): "
                              "only the process that attached can call as it")


def sweep_stale_segments() -> list[str]:
    """Unlinks /dev/shm segments left by older versions (named files; shm regions are unnamed
    memfds now) whose creator process is gone."""
    removed = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        if name.startswith(SHM_PREFIX):
            pid = shm_owner_pid(name)
            if pid is not None and not pid_alive(pid) and unlink_segment(name):
                removed.append(name)
    if removed:
        log.warning("transport: removed %d stale shm segments of dead processes", len(removed))
    return removed
