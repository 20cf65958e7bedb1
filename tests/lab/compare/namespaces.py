"""Whether network namespaces can be made here, probed once for the modules whose tests make
them (``test_netns.py``, ``test_layout_run.py``): the probe runs at import, outside any test."""

from __future__ import annotations

import subprocess

from gravac_lab.compare import netns


def _namespaces_can_be_made() -> str | None:
    reason = netns.shaping_unavailable()
    if reason is not None:
        return reason
    probe = f"{netns.prefix()}probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", probe], check=True)
    return None


#: why network namespaces cannot be made here (``None``: they can)
UNAVAILABLE = _namespaces_can_be_made()
