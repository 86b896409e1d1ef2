"""The drafter service: DFlash drafting over gRPC (servicer, client, `ddtree serve drafter`)."""
