"""The long-running agent: composition root, reconcile engine, systemd notify, HTTP."""
