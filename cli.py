"""Run the mlxllama command line from a checkout: `python cli.py generate ...`."""

from mlxllama.cli import main

if __name__ == "__main__":
    main()
