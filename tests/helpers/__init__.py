"""What the tests and their worker scripts share (imported as ``helpers.*``: tests/ is on their path)."""
