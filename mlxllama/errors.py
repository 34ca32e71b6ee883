"""The one exception type the CLI turns into a one-line message and exit code 2."""


class MlxLlamaError(Exception):
    """A problem with user input (a file, a template, a flag) that the user can fix."""
