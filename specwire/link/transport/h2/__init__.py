"""Synchronous draft sessions as gRPC over HTTP/2 on the h2 state machine: the
connection, the node's multiplexer and server, gRPC framing and flood limits.

A second stack beside grpcio (which carries pipelined sessions, Hello and Ping),
kept for its measured gain: a synchronous round's link cost on the sync port is
about 50-70% of the same round's on grpcio's main port (`python -m
benchmarks.stacks`; figures in docs/protocol.md, "Two stacks")."""
