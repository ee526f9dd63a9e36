"""One rank of a split-placement run (`async.generation_ranks=1`) under torchrun, through the Python API: the
trainer of `test_trainer_async._trainer`; rank 0 saves the trained Actor, the history and each iteration's token
ages under `out`. Used by `test_trainer_split.py`:

    torchrun --nproc-per-node 2 split_driver.py RUN_DIR CACHE OUT STALENESS [--stop-at N] [--resume] [--generator NAME] [--data small|wide]
    [--partial] [--interrupt] [--frozen-on-generation-rank]"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from test_trainer_async import SMALL, WIDE, StopAt, Versions, _actor, _model, _trainer

from rlhfuse import distributed
from rlhfuse.runtime.launch import Watchdog
from rlhfuse.trainer import CheckpointConfig
from rlhfuse.trainer.split import GenerationService


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("run_dir", "cache", "out"):
        parser.add_argument(name, type=Path)
    parser.add_argument("staleness", type=int)
    parser.add_argument("--stop-at", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--generator", default="sampling")
    parser.add_argument("--data", choices=("small", "wide"), default="small")
    parser.add_argument("--partial", action="store_true")
    parser.add_argument("--interrupt", action="store_true")
    parser.add_argument("--frozen-on-generation-rank", action="store_true")
    args = parser.parse_args()
    if args.interrupt:  # the sync of version 1 lands at batch 2's third decode step
        generate, step = GenerationService._generate, GenerationService.step

        def counted(self: Any, iteration: int, prompts: Any) -> Any:
            self.test_batch, self.test_steps = iteration, 0
            return generate(self, iteration, prompts)

        @contextlib.contextmanager
        def held(self: Any) -> Iterator[int]:
            self.test_steps += 1
            if self.test_batch == 2 and self.test_steps == 3:
                self._notice.wait()  # the training rank's notice of version 1
            with step(self) as version:
                yield version

        GenerationService._generate, GenerationService.step = counted, held  # type: ignore[method-assign]
    versions = Versions()
    callbacks = [versions, *([StopAt(args.stop_at)] if args.stop_at else [])]
    trainer = _trainer(
        args.run_dir, staleness=args.staleness, generation_ranks=1, callbacks=callbacks, generator=args.generator,
        data=WIDE if args.data == "wide" else SMALL, partial=args.partial,
        frozen_inference="generation_ranks" if args.frozen_on_generation_rank else "training_ranks",
        checkpoint=CheckpointConfig(every=10), resume="auto" if args.resume else "never",
    )  # fmt: skip
    history = trainer.fit(_model(args.cache))
    trainer.generator.close()
    if trainer.fabric.global_rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        torch.save({"actor": _actor(trainer), "ages": versions.ages}, args.out / "actor.pt")
        (args.out / "history.json").write_text(json.dumps(history))
    Watchdog.current.disarm()  # the peer now exits on its own
    distributed.shutdown()
    distributed.exit_finished()


if __name__ == "__main__":
    main()
