"""The ``kvtier`` command line."""
