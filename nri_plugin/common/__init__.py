"""Small building blocks any layer may use; nothing here knows NRI, cgroups or the policy.

* ``heap``: gives glibc's free heap back to the system after a large message.

This ``__init__`` imports nothing.
"""
