"""`python -m aenv.code_interpreter`."""

from aenv.code_interpreter.main import main

main()
