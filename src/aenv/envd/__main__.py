"""`python -m aenv.envd`."""

from aenv.envd.main import main

main()
