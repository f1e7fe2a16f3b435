"""An engine's error keeps what its frames held (vLLM's model runner, its weights and KV cache) until those frames
are released: ``faults.release_frames``, called before an engine restarts (``keeper._restart``)."""

import gc
import weakref

from megarl.faults import release_frames


class Engine:  # stands for what a vLLM frame holds: anything the error's frames reference
    pass


def _step(engine: Engine) -> None:
    cache = [engine]  # noqa: F841  (a local of the failing frame)
    raise RuntimeError("engine step failed")


def _sync(engine: Engine) -> None:
    try:
        _step(engine)
    except RuntimeError as exc:
        raise ValueError("weight sync failed") from exc


def test_an_errors_frames_release_what_they_held_and_the_error_still_prints():
    engine = Engine()
    alive = weakref.ref(engine)
    try:
        _sync(engine)
    except ValueError as caught:
        err = caught
    del engine
    gc.collect()
    assert alive() is not None  # held by the frames of the error (and of its cause)
    release_frames(err)
    gc.collect()
    assert alive() is None
    import traceback

    text = "".join(traceback.format_exception(err))
    assert "_step" in text and "engine step failed" in text and "weight sync failed" in text
    release_frames(None)  # (no error: nothing to do)
