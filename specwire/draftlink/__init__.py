"""The draft link's domain: what a target and a draft node say, and the branch rule.

Pure data and one rule, with no transport and no protobuf: drafters/ (both ends
of a branch session) and node/ work on these; wire/protocol.py alone converts
them to and from the protobuf messages of wire/specwire.proto.
"""
