"""Progress of the long waits of loading a model: uploads to a GPU, -rtr repacking, reading
the experts into page-locked RAM. The engine reports each as a task of so many bytes; a
command-line tool listens and draws bars (cli/common.py loading). Nobody listening: nothing
is drawn, and a task costs a function call per step.
"""
from contextlib import contextmanager

_listeners = []


@contextmanager
def listening(listener):
    """Send tasks to `listener` within the block: listener.start(description, total) returns
    an id, listener.advance(id, n) and listener.finish(id) follow."""
    _listeners.append(listener)
    try:
        yield listener
    finally:
        _listeners.remove(listener)


@contextmanager
def task(description, total):
    """A wait of `total` units (bytes); yields advance(n), to call as parts are done."""
    ids = [(lst, lst.start(description, total)) for lst in _listeners]

    def advance(n):
        for lst, i in ids:
            lst.advance(i, n)
    try:
        yield advance
    finally:
        for lst, i in ids:
            lst.finish(i)


def chunks(n_bytes, step):
    """(start, stop) byte ranges of at most `step` covering n_bytes: a long copy cut so its
    bar moves."""
    return [(lo, min(lo + step, n_bytes)) for lo in range(0, n_bytes, step)]
