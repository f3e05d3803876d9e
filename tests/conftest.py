"""Suite-wide settings. Triton kernels run on the CPU only under its interpreter, which must be
chosen before any kernel module is imported."""

import os

from services.worker.openmp import set_wait_policy

# Tests run beside worker processes on 2 cores: OpenMP threads spinning long would starve each
# other (services/worker/openmp.py). Set before torch loads OpenMP.
set_wait_policy()

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_sessionfinish(session, exitstatus):
    """A thread left running (an unclosed aiosqlite connection, say) would keep the interpreter
    from exiting and CI waiting until its time limit. Give a clean exit a minute; past that, print
    every thread's stack and end the run as failed."""
    import faulthandler
    import sys
    import threading
    import time

    def watchdog() -> None:
        time.sleep(60)
        print("\npytest did not exit within 60 s of the session's end; live threads:", file=sys.__stderr__, flush=True)
        faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)
        os._exit(int(exitstatus) or 1)

    threading.Thread(target=watchdog, name="exit-watchdog", daemon=True).start()
