"""Every check made before a process starts, in one package: what ``megarl train``, ``eval`` and ``plan`` call.

| module | checks |
| --- | --- |
| ``settings.py`` | ``validate``: each section's values, on their own and against each other (the entry point) |
| ``layout.py`` | the parallel layout against the world, the model's shape and the job's nodes (one copy of the rules) |
| ``model.py`` | the model against the layout and the engine; the checkpoint a resume continues from |
| ``algo.py`` | ``algo.*`` ranges and combinations; the note on stale data with no off-policy correction |
| ``lora.py`` | ``lora.*`` values, targets against the model, what LoRA does not run yet |
| ``limits.py`` | what torch or vLLM would refuse only after launch (ranges, engine sizes, memory, head sizes) |
| ``prelaunch.py`` | ``checked_config``: the whole sequence, with the data, the reward function and the environment |

Choice-valued keys need no check here: they are ``Literal`` types, refused by the loader.
"""

from megarl.config.validate.settings import validate

__all__ = ["validate"]
