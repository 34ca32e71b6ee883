"""`python -m mlxllama ...`, the same as the `mlxllama` command."""

from .cli import main

main()
