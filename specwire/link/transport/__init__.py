"""How the link's messages travel: the protobuf edge (protocol.py, specwire.proto), the
grpcio client and its channels, and the synchronous sessions on HTTP/2 (h2/)."""
