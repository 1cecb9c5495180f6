"""The error type of the data package: bad input, named with the file or key and the fix."""


class DataError(ValueError):
    """Bad data input (a path, a column, a shard, a tokenizer); the message says what to do."""
