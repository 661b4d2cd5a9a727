"""envd: the in-sandbox daemon speaking the E2B envd protocol (version 0.6.13) on port 49983.

It runs inside the guest only and never imports host-side packages of `aenv`.
"""

ENVD_VERSION = "0.6.13"
ENVD_PORT = 49983
