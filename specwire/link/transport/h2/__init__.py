"""Synchronous draft sessions as gRPC over HTTP/2 on the h2 state machine: the
connection, the node's multiplexer and server, gRPC framing and flood limits."""
