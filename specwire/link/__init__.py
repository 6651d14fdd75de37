"""The draft link: both ends of a branch session and how their messages travel.

messages.py and rule.py are the domain (pure data and the branch rule); branch.py is
the target's end, session.py the draft node's, remote.py and threaded.py join the
target's end to a transport (transport/: the protobuf edge, gRPC and HTTP/2).
"""
