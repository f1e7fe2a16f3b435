"""A DataError in the middle of a run (every row of the dataset unusable, the CLI's pre-launch check bypassed by
calling ``megarl.train.run`` directly): the run stops at once, not as an engine fault (no engine restart, no
requeue), and the message counts one walk over the rows. Prints one JSON object."""

import contextlib
import io
import json
import sys

from megarl.config import load_config
from megarl.train import run


def main(config: str, work: str) -> None:
    cfg = load_config(config, [f"data.path={work}/bad.jsonl", "data.eval_path=", f"train.run_dir={work}/run_bad",
                               "train.steps=2", "reward.fn=exact"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = run(cfg)
    text = out.getvalue()
    sys.stderr.write(text[-4000:])
    print(json.dumps({"stopped": result.stopped, "error": result.error, "requeue": result.requeue,
                      "steps": result.steps, "engine_errors": text.count("engine error"),
                      "restarts": text.count("restart 1/")}))


if __name__ == "__main__":  # checkpoint saves start a multiprocessing manager (spawn re-imports this file)
    main(sys.argv[1], sys.argv[2])
