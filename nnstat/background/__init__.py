"""nnstat.background: host staging, the one home of work beside training.

* threads (`nnstat.background.worker`): `submit` runs a job on the one shared statistics
  worker (the Tracker's background steps); `start_one_thread_worker` starts a dedicated thread
  with one intra-op torch thread (the gradient store's writer); `Reader` runs an iterator a few
  items ahead on its own thread (the scoring pipeline's shard reads). A `Relay` re-raises a
  thread's error where its result is collected: nothing is swallowed.
* host memory (`nnstat.background.transfer`): `HostBuffers` pools host buffers (pinned for a
  CUDA device), each handed back with the event after which the device no longer reads it;
  `copy_to_host` and `start_copy` move device results to the host without waiting.
* deferred results (`nnstat.background.deferred`): `Deferred` resolves on first read, `InOrder`
  completes results oldest first once their copies have arrived.

Example:
    >>> from nnstat.background import submit
    >>> submit(lambda: 6 * 7).result()
    42
"""

from nnstat.background.worker import Job, Reader, Relay, start_one_thread_worker, submit

__all__ = ["Job", "Reader", "Relay", "start_one_thread_worker", "submit"]
