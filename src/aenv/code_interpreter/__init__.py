"""The code interpreter: the server on port 49999 that `e2b-code-interpreter` SDKs talk to,
backed by Jupyter kernels (`jupyter_client`). It runs inside a sandbox of the
`code-interpreter-v1` template and needs nothing host-side.

Modules: `events` (what the NDJSON stream carries), `kernels` (contexts and their kernels),
`execution` (one run of code, streamed), `app` (the HTTP routes), `main` (the entry point).
"""
