"""Launching on clusters: who am I in the job (``bootstrap``) and will this layout fit (``plan``).

Neither module imports torch at module level: ``megarl plan`` runs on a login node.
"""
