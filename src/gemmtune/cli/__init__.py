"""The `gemmtune` command line: thin wrappers that parse arguments and call the Python API."""
