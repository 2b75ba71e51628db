"""`python -m gemmtune ...`: the command line, as the `gemmtune` script runs it."""

from .cli.main import main

main()
