"""The web dashboard at `/dashboard`: pages over the control plane, signed in with an API key.

Every read and change a page makes is a call of the node's own API with the session's key
(`calls.py`), so a session can do exactly what its key can, and a revoked key ends it.
"""
