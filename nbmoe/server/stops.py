"""Stop strings: the generated text up to the first one, never a part of one.

Text that could be the start of a stop string is held back until the next pieces show
whether it is; at the end of the reply it is released.
"""


class StopScanner:
    def __init__(self, stops):
        self.stops = [s for s in stops if s]
        self.held = ""

    def push(self, text):
        """(text safe to send, whether a stop string ended the reply)."""
        if not self.stops:
            return text, False
        buf = self.held + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            return buf[:min(hits)], True
        keep = 0      # the longest end of buf that begins a stop string
        for k in range(min(len(buf), max(map(len, self.stops)) - 1), 0, -1):
            if any(s.startswith(buf[-k:]) for s in self.stops):
                keep = k
                break
        self.held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep], False

    def flush(self):
        out, self.held = self.held, ""
        return out
