"""The code interpreter: the server on port 49999 that `e2b-code-interpreter` SDKs talk to,
backed by Jupyter kernels (`jupyter_client`). It runs inside a sandbox of the
`code-interpreter-v1` template and needs nothing host-side.

Modules: `events` (what the NDJSON stream carries), `kernels` (contexts and their kernels),
`execution` (one run of code, streamed), `sandbox_env` (the sandbox's env vars, from envd),
`app` (the HTTP routes), `main` (the entry point), `tslab_specs` (the JavaScript and
TypeScript kernelspecs, run by `tslab_kernel.js`).
"""
