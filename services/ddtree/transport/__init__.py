"""Zero-copy tensor channel between services on one host (see docs/transport.md).

Producer: `Transport(TransportConfig(...))` (self-tests its kind), `create_region(...)`,
`region.view/put/record/ref`. Consumer: `Transport.attach` (server Attach RPC) or `PeerLink`
(client), then `resolve`. Servicers: `serve_peer`, `attach`, `add_transport_service`.

Names load lazily (PEP 562), so importing a torch-free submodule (probe_server's CLI parser)
does not import torch.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "ddtree.transport.endpoint": ["Transport", "TransportConfig", "PeerScope", "sweep_stale_segments"],
    "ddtree.transport.errors": ["TransportError", "BadTensorRef", "BadRegionHandle", "UnknownPeer",
                                "AttachDenied", "Unauthenticated", "TransportUnavailable"],
    "ddtree.transport.host": ["host_id"],
    "ddtree.transport.peer": ["PeerLink"],
    "ddtree.transport.region": ["Region", "ImportedRegion", "CUDA_IPC", "SHM", "INLINE", "align", "kind_name"],
    "ddtree.transport.service": ["TransportServicer", "add_transport_service", "attach", "serve_peer",
                                 "transport_errors", "peer_id_of", "checksum", "PEER_METADATA_KEY",
                                 "PEER_SECRET_METADATA_KEY",
                                 "PROBE_READ_METADATA_KEY", "DEFERRED_READ", "RESOLVE_ONLY"],
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'ddtree.transport' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
