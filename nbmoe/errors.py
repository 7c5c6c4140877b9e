"""The one error type users see: its message is a single line, printed without a traceback."""


class NbmoeError(Exception):
    pass
