"""Console progress and TensorBoard output."""


def test_progress_line_has_eta_bounded_by_time_limit(tmp_path):
    import io

    from megarl.logging.metrics import MetricsLogger

    out = io.StringIO()
    logger = MetricsLogger(tmp_path, total_steps=1000, enabled=True, stream=out, time_limit_s=60)
    logger.start -= 10  # 10 s for 1 step: 999 steps would take ~2.8 h, the time limit leaves ~50 s
    logger.progress(1, {"reward/mean": 0.5}, ("reward/mean",))
    line = out.getvalue().strip()
    assert line.startswith("step 1/1000 | reward/mean 0.5 | elapsed 0m10s eta 0m")
    assert int(line.rsplit("eta 0m", 1)[1].rstrip("s")) <= 50
    logger.scalars(1, {"reward/mean": 0.5})
    logger.close()
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_eta_of_a_resumed_run_counts_the_steps_this_process_ran(tmp_path):
    """Resumed at step 38 of 60, 2 steps in 10 s: 20 steps left take ~100 s (it said 0m02s: the elapsed time of
    this process over all 40 steps)."""
    import io

    from megarl.logging.metrics import MetricsLogger

    out = io.StringIO()
    logger = MetricsLogger(tmp_path, total_steps=60, enabled=True, stream=out)
    logger.reset_clock(38)
    logger.start -= 10
    logger.progress(40, {}, ())
    assert out.getvalue().strip() == "step 40/60 | elapsed 0m10s eta 1m40s"
    logger.close()
