"""The interpreter probes that see which user functions a trace runs: `sys.monitoring` or `sys.setprofile`.

One probe is installed while any recorder of a thread is active, and dispatches each user function start
to that thread's recorders (`Recorder._note`). The `traceback` mode installs none.
"""

from __future__ import annotations

import os
import sys
import threading

from .._base import _origin
from .._base._compat import tracebacks_usable as _tracebacks_usable


class _Probes:
    """Installs one interpreter probe while any recorder is active; dispatches to the thread's recorders."""

    def __init__(self):
        self.lock = threading.Lock()
        self.active: dict[int, list] = {}  # thread id -> active `Recorder`s, outermost first
        self.tool: int | None = None  # sys.monitoring tool id while claimed
        self.monitoring_users = 0
        self.profile_prev: dict[int, tuple] = {}  # thread id -> (profiler to restore, our probe)

    # ---- entry and exit

    def enter(self, rec) -> str:
        """Activate `rec` in its thread; returns the way it records (`monitoring`, `traceback`, `profile`)."""
        wanted = os.environ.get("NITRO_IPY_RECORDER") or ("monitoring" if hasattr(sys, "monitoring") else "traceback")
        with self.lock:
            stack = self.active.setdefault(rec._tid, [])
            stack.append(rec)
            if len(stack) > 1:
                return stack[0]._mode  # the thread's probe is installed already
            if wanted == "monitoring" and hasattr(sys, "monitoring") and self._claim_monitoring():
                return "monitoring"
        if wanted == "profile" or not _tracebacks_usable():
            return self._install_profile(rec._tid, stack)
        return "traceback"

    def exit(self, rec) -> None:
        with self.lock:
            stack = self.active.get(rec._tid, [])
            if rec in stack:
                stack.remove(rec)
            if stack:
                return
            self.active.pop(rec._tid, None)
            if rec._mode == "monitoring":
                self._release_monitoring()
                return
        if rec._mode == "profile":
            self._remove_profile(rec._tid)

    # ---- sys.monitoring (3.12+): one global callback, library code disabled after its first call

    def _claim_monitoring(self) -> bool:
        mon = sys.monitoring
        if self.tool is None:
            # 0, 1, 2 and 5 are the debugger's, coverage's, profiler's and optimizer's by convention.
            for tool in (4, 3):
                try:
                    mon.use_tool_id(tool, "nitro_ipy")
                except ValueError:
                    continue
                self.tool = tool
                break
            else:
                return False
            mon.register_callback(self.tool, mon.events.PY_START, self._on_py_start)
            mon.set_events(self.tool, mon.events.PY_START)
        self.monitoring_users += 1
        return True

    def _release_monitoring(self) -> None:
        self.monitoring_users -= 1
        if self.monitoring_users == 0 and self.tool is not None:
            mon = sys.monitoring
            mon.set_events(self.tool, 0)
            mon.register_callback(self.tool, mon.events.PY_START, None)
            mon.free_tool_id(self.tool)
            self.tool = None

    def _on_py_start(self, code, offset):
        verdict = _origin.verdicts.get(code.co_filename)
        if verdict is None:
            verdict = _origin.is_user_file(code.co_filename)
        if not verdict:
            return sys.monitoring.DISABLE  # library code is never tracked: stop paying for it
        stack = self.active.get(threading.get_ident())
        if stack:
            frame = sys._getframe(1)
            if frame.f_code is code:
                for rec in stack:
                    rec._note(frame, code)
        # User code is never disabled: a later recorder (or another thread's) needs its events.
        return None

    # ---- sys.setprofile (3.11): per thread, chained to a Python-level profiler already installed

    def _install_profile(self, tid: int, stack: list) -> str:
        prev = sys.getprofile()
        if prev is not None and not callable(prev):
            # A C profiler (cProfile on 3.11) cannot be chained or restored from Python: leave it alone
            # and read the trace's tracebacks instead.
            return "traceback"
        get_verdict = _origin.verdicts.get
        is_user_file = _origin.is_user_file

        def probe(frame, event, arg):
            # Runs on every call and C call of the trace: keep it minimal.
            if event == "call":
                code = frame.f_code
                verdict = get_verdict(code.co_filename)
                if verdict is None:
                    verdict = is_user_file(code.co_filename)
                if verdict:
                    for rec in stack:
                        rec._note(frame, code)

        if prev is not None:
            inner = probe

            def probe(frame, event, arg):  # noqa: F811 (chained variant)
                inner(frame, event, arg)
                return prev(frame, event, arg)

        self.profile_prev[tid] = (prev, probe)
        sys.setprofile(probe)
        return "profile"

    def _remove_profile(self, tid: int) -> None:
        prev, probe = self.profile_prev.pop(tid, (None, None))
        if sys.getprofile() is probe:
            sys.setprofile(prev)


probes = _Probes()
