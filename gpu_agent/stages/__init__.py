"""Reconcile stages, run in order by the engine: discovery first, then (as they are built) the rest."""
