"""Run launch/train.py's command line in this process (one rank, under the DeepSpeed launcher or
plain python) and record at every pruning event's heap release: whether the start-up objects were
frozen for the collector, how many weights alive when training began were replaced and are
still alive, and whether the first engine is. A freeze that covered the model and the engine
kept every replaced weight alive under DeepSpeed (its engine and parameters form cycles).

    freed_weights_probe.py RESULT.json -- TRAIN ARGS...   (the launcher adds --local_rank=N first)"""

from __future__ import annotations

import gc
import json
import sys
import weakref

import apt_ds.training.trainer as trainer_module
from apt_ds.cli.train import main as train_main


def main() -> None:
    split = sys.argv.index("--")
    result_path = next(a for a in sys.argv[1:split] if not a.startswith("--local_rank"))
    train_args = sys.argv[split + 1:]
    watched: dict = {}
    events: list[dict] = []
    original_train, original_release = trainer_module.APTrainer.train, trainer_module.release_free_heap

    def train(self, *args, **kwargs):
        watched["model"] = self.model
        watched["weights"] = [weakref.ref(p) for p in self.model.parameters()]
        engine = getattr(self.backend, "engine", None)
        watched["engine"] = weakref.ref(engine) if engine is not None else None
        del engine  # this frame lives as long as training: hold no reference here
        return original_train(self, *args, **kwargs)

    def release():
        released = original_release()
        current = {id(p) for p in watched["model"].parameters()}
        alive = [ref() for ref in watched["weights"]]
        engine = watched["engine"]
        events.append({"frozen": gc.get_freeze_count() > 0,
                       "replaced_alive": sum(1 for p in alive if p is not None and id(p) not in current),
                       "replaced": sum(1 for p in alive if p is None or id(p) not in current),
                       "first_engine_alive": engine is not None and engine() is not None})
        del alive
        return released

    trainer_module.APTrainer.train = train
    trainer_module.release_free_heap = release
    code = train_main(train_args)
    with open(result_path, "w") as handle:
        json.dump({"code": code, "events": events, "frozen_after": gc.get_freeze_count()}, handle)


if __name__ == "__main__":
    main()
