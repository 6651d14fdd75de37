"""gRPC over HTTP/2 on the h2 state machine, both ends of the link: the connection,
the node's multiplexer and server, gRPC framing and flood limits.

The link's only stack: a synchronous round's link cost here was about 50-70% of the
same round's on grpcio (docs/protocol.md, "One stack")."""
