"""Advantages, losses and batch weighting: small pure-torch functions carrying their formula."""
