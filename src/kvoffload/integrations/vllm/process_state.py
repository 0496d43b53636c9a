"""Undo what an in-process vLLM engine changes in the process's threading.

vLLM's CPU worker pins the process to some cores (``os.sched_setaffinity``) and sets, then
replaces, ``torch.set_num_threads``. A process that starts more than one engine in turn (a
test suite, a benchmark that runs one configuration after another) calls
``save_thread_state`` before each engine and the returned undo after it, so every engine
starts from the machine's cores and torch's own thread count.

Needs torch (the ``torch`` extra); it is imported on call, so importing this module does not.
"""

from __future__ import annotations

import os
from collections.abc import Callable


def save_thread_state() -> Callable[[], None]:
    """Record the process's core affinity, torch's thread count and torch's
    ``set_num_threads`` as they are now; return a function that puts all three back.

    The undo may be called more than once; each call restores the recorded state.
    """
    import torch

    affinity = os.sched_getaffinity(0)
    threads = torch.get_num_threads()
    set_num_threads = torch.set_num_threads

    def restore() -> None:
        torch.set_num_threads = set_num_threads
        os.sched_setaffinity(0, affinity)
        torch.set_num_threads(threads)

    return restore
