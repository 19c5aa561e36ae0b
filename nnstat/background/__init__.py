"""nnstat.background: the threads that work beside training, and never swallow an error.

`submit` runs a job on the one shared statistics worker (the Tracker's background steps);
`start_one_thread_worker` starts a dedicated thread with one intra-op torch thread (the gradient
store's writer). Both re-raise a failure in the thread that collects the result.
`nnstat.background.transfer.start_copy` moves device results to the host without waiting for
the device (one non-blocking copy into pinned memory, polled by its CUDA event).

Example:
    >>> from nnstat.background import submit
    >>> submit(lambda: 6 * 7).result()
    42
"""

from nnstat.background.worker import Job, start_one_thread_worker, submit

__all__ = ["Job", "start_one_thread_worker", "submit"]
