"""The process services every layer above uses (imports nothing on its own; no torch in the
modules the persistent writer loads):

* :mod:`.collectives` — rank and world with or without a process group, the agreement step
  (``run_agreed``: an error on one rank raised on every rank), the small gathers;
* :mod:`.async_request` — an async request and its finalization; :mod:`.async_callers` —
  Megatron-Core's callers (a forked process per call, one persistent worker);
* :mod:`.forked_call` — a function run in a forked copy-on-write child;
  :mod:`.memory_maps` — which tensors a fork does not isolate;
* :mod:`.arenas` — the shared, pinned staging arenas of async saves and the device-to-host
  copies into them;
* :mod:`.persistent_worker` — one worker process per trainer (a new interpreter) that writes
  from the arenas; :mod:`.process_qos` — the writers' CPU and I/O priorities;
* :mod:`.progress` — byte progress of a write, from any thread or process.
"""
