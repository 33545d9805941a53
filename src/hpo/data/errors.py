"""The one exception type for problems with data files."""


class DataError(ValueError):
    """A problem with a data file; str(e) is ONE line naming the file (and column/row if known).

    The CLI prints the message as-is on stderr and exits with code 2, so line breaks that a bad
    value could smuggle in are folded into spaces here rather than trusted to every caller.
    """

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.splitlines()))
