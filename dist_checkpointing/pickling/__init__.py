"""Every pickle this library opens, in one place (imports nothing on its own):

* stored bytes — :mod:`.safe_load` (``torch.load`` under the allow-list of :mod:`.safe_globals`,
  the user's safe globals and the Megatron-Core / Transformer Engine stand-ins of
  :mod:`.stand_ins`; DCP ``.metadata``), :mod:`.blob_header` (the ``data.pkl`` of a tensor's
  ``torch.save`` blob) and :func:`.restricted.loads_plain` (plain data), all under the one rule
  of :mod:`.restricted`: only allow-listed globals, nothing else imported or called;
* bytes of this job's own processes (other ranks, forked children) — :mod:`.trusted`;
* the classes a DCP ``.metadata`` may hold, which the allow-list admits and the readers
  check against — :mod:`.dcp_types` (DCP's own, or light stand-ins where DCP is not imported).
"""
