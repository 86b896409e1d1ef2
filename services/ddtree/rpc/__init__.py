"""The RPC layer every service shares: the server scaffold (server), channel and server options
(options), health waits (health), the bounded handler pool (limits), request-size checks of the
wire bytes (decoding) and long-lived step streams (step_stream). Service clients live beside
their servicers (ddtree.drafter.client, ddtree.treebuild.client)."""
