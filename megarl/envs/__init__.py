"""Multi-turn environments: the protocol (``base.py``), the built-in tool environment (``tools.py``) and the sandboxed
worker pool that runs them (``pool.py``); the controller's side of an episode is ``megarl/rollout/turns.py``, the
rendering of a turn ``megarl/data/chat.py``."""
