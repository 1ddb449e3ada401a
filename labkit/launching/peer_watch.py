"""In a grading rank: stop soon after a peer failed the case this rank is still in.

A rank still in a case that another rank has failed is, as a rule, waiting for that rank (in a
collective or a recv it will never join). `PeerWatch` polls the store for the peers' verdicts on
the current case from a thread; when one says "failed" and this rank is still in the case a
second later, it writes the main thread's stack (faulthandler's format, innermost first) and a
"stopped" line to the case log, and ends the process. `labkit.grading.cases` reads both.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time

OK = "ok"
PEER_GRACE = 1.0  # seconds a rank still in a case waits, after a peer failed it, before it stops


class PeerWatch:
    """Stop this rank soon after a peer failed the case it is still in (it waits for that peer)."""

    def __init__(self, store, rank, world_size, log, stack):
        self.store, self.rank, self.world_size, self.log, self.stack = store, rank, world_size, log, stack
        self.current = None  # (index, key) of the case running now
        self.main = threading.main_thread().ident
        threading.Thread(target=self._watch, daemon=True, name="labkit-peer-watch").start()

    def enter(self, index, key):
        self.current = (index, key)

    def leave(self):
        self.current = None

    def _failed_peers(self, index) -> list[int]:
        failed = []
        for r in range(self.world_size):
            name = f"labkit/cases/{index}/{r}"
            if r != self.rank and self.store.check([name]) and self.store.get(name).decode() != OK:
                failed.append(r)
        return failed

    def _watch(self):
        try:
            while True:
                time.sleep(0.1)
                current = self.current
                failed = self._failed_peers(current[0]) if current else []
                if not failed:
                    continue
                time.sleep(PEER_GRACE)  # a rank about to finish the case may still do so
                if self.current is current:
                    self._stop(current[1], failed)
        except Exception:  # the store went away: the launch is ending anyway
            return

    def _stop(self, key, failed):
        frame, lines = sys._current_frames().get(self.main), []
        while frame is not None:  # the main thread's stack, innermost first, as faulthandler writes it
            lines.append(f'  File "{frame.f_code.co_filename}", line {frame.f_lineno} in {frame.f_code.co_name}')
            frame = frame.f_back
        self.stack.write("\n".join(lines) + "\n")
        self.stack.flush()
        self.log.write(json.dumps({"stopped": repr(key), "after": failed}) + "\n")
        self.log.flush()
        os._exit(0)
