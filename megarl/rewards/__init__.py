"""Verifiable rewards behind one protocol; failures and timeouts are contained and counted."""
