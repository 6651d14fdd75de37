"""How the link's messages travel: the protobuf edge (protocol.py, specwire.proto), the
target's transport and its connections (grpc_client.py, channel.py, channels.py), and
gRPC over HTTP/2 for both ends (h2/)."""
