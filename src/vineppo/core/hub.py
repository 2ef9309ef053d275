"""Whether the Hugging Face Hub is there: the offline switches, and a quick connection test.

Models (`models.load_model`) and data sets (`tasks.data.load_hub`) ask before they try the Hub, so that an
offline machine gets one clear line at once instead of a library's retries.
"""

from __future__ import annotations

import os
import socket
import threading


def offline(*switches: str) -> bool:
    """True when HF_HUB_OFFLINE, or one of `switches` (e.g. TRANSFORMERS_OFFLINE), is set to a true value."""
    return any(os.environ.get(k, "").strip().lower() in ("1", "true", "yes", "on") for k in ("HF_HUB_OFFLINE", *switches))


def reachable(host: str = "huggingface.co", port: int = 443, timeout: float = 3.0) -> bool:
    """Whether a TCP connection to the Hub opens within `timeout` seconds (DNS included, hence the thread)."""
    ok = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            ok.append(True)
        except OSError:
            pass

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t.join(timeout)
    return bool(ok)
