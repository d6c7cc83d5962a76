"""Every typed message that crosses a mailbox, and the codecs. Imports nothing of ours but gpu/batch.py
(the scheduler's contract with the worker, which imports msgspec only)."""
