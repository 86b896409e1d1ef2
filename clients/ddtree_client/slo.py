"""Goodput SLOs of `ddtree-client loadtest` (no numpy: the CLI reads the defaults for --help)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SLO:
    """Service-level objectives for goodput: a request counts when it met both (DistServe's definition)."""
    ttft_ms: float = 1000.0   # time to first token
    tpot_ms: float = 50.0     # time per output token after the first (a one-token request meets it)

    def __post_init__(self):
        if not (self.ttft_ms > 0 and self.tpot_ms > 0):
            raise ValueError(f"SLOs must be > 0 ms, got TTFT {self.ttft_ms} and TPOT {self.tpot_ms}")

    def met(self, record) -> bool:
        """Whether a RequestRecord finished within both objectives (a failed one never does)."""
        return (record.ok and record.ttft_s is not None and record.ttft_s * 1e3 <= self.ttft_ms
                and (record.tpot_s is None or record.tpot_s * 1e3 <= self.tpot_ms))

    def describe(self) -> str:
        return f"TTFT <= {self.ttft_ms:g} ms and TPOT <= {self.tpot_ms:g} ms"
