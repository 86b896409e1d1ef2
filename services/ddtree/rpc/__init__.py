"""The RPC layer every service shares: the server scaffold (server), channel and server options
(options), health waits (health), the bounded handler pool (limits), request-size checks of the
wire bytes (decoding), long-lived step streams (step_stream) and the clients' base class (peer:
RemotePeer). Each service's client lives beside its servicer (ddtree.drafter.client,
ddtree.treebuild.client); the verify service wires them (ddtree.verify.peers)."""
