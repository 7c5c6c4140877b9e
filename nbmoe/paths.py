"""Where nbmoe keeps what it builds: $NBMOE_CACHE, else $XDG_CACHE_HOME/nbmoe, else ~/.cache/nbmoe."""
import os


def cache_dir():
    if os.environ.get("NBMOE_CACHE"):
        return os.environ["NBMOE_CACHE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "nbmoe")
