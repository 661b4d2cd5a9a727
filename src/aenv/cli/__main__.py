"""`python -m aenv.cli`."""

from aenv.cli.main import main

main()
