"""Database guests under libvirt/QEMU, traced from the host (the e-commerce storage study).

Modules: ``daemon`` (libvirtd), ``domain`` (XML), ``guest`` (lifecycle),
``nbd`` (the traced, copy-on-write block path) run by ``tracer`` in its own
process, ``diskmodel``, ``workload`` with ``tpcc``/``tpcw``/``rubis``,
``analysis`` (the study's metrics, trace file, LBA plot), ``run`` (one traced
run), ``report``, ``cli`` (``dbtrace``) and ``alongside`` (database guests
next to a microVM run).
"""
