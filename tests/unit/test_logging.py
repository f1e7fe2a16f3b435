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


def test_a_finished_runs_pass_at_1_after_rl_is_its_final_evaluation(tmp_path):
    """A finished run resubmitted (``make demo`` again) reports the pass@1 its own final evaluation recorded (it said
    nan): the last ``final`` line's, not an evaluation during the run; NaN where the run has none."""
    import math

    from megarl.logging.metrics import MetricsLogger, final_pass_at_1

    logger = MetricsLogger(tmp_path, total_steps=4, enabled=True)
    logger.scalars(0, {"eval/pass_at_1": 0.28})
    logger.scalars(2, {"eval/pass_at_1": 0.35, "reward/mean": 0.1})
    assert math.isnan(final_pass_at_1(tmp_path / "metrics.jsonl"))  # no final evaluation yet
    logger.scalars(4, {"eval/pass_at_1": 0.44}, final=True)
    logger.close()
    assert final_pass_at_1(tmp_path / "metrics.jsonl") == 0.44
    assert math.isnan(final_pass_at_1(tmp_path / "absent.jsonl"))
