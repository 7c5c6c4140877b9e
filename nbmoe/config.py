"""Every tunable of nbmoe in one place, each with the environment variable that overrides it.

Read once at import. A value here is a default that was measured to be good; the variable is
for trying another on your machine, not a feature switch.
"""
import os


def env_int(name, default):
    """An integer from the environment, or default when unset or empty."""
    text = os.environ.get(name, "")
    return int(text) if text.strip() else default


def env_flag(name, default):
    """A boolean from the environment ("1" on, "0" off), or default when unset or empty."""
    text = os.environ.get(name, "").strip()
    return default if not text else text not in ("0", "false", "no", "off")
