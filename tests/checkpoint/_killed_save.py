"""Child process of the fault tests: saves a checkpoint at step 2, trains on, and starts a second
save to the same path that stops part-way (``parts``: after its first shard file; ``commit``:
with the manifest written, just before the directory is put in place), signals the parent and
waits to be killed.

    python _killed_save.py PATH SIGNAL_FILE {parts,commit}
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

import dynemb
from dynemb import checkpoint
from dynemb.checkpoint import writer

import _models as M


def stop_here(*args, **kwargs):
    Path(sys.argv[2]).write_text("stopped")
    time.sleep(600)


def main() -> None:
    torch.set_num_threads(1)
    path, phase = Path(sys.argv[1]), sys.argv[3]
    model = M.Tiny(dynemb.EmbeddingBagCollection(M.tables()))
    opt = torch.optim.Adam(model.mlp.parameters(), lr=0.01)
    M.train(model, opt, range(2))
    checkpoint.save(path, model=model, dense_optimizer=opt, step=2)
    M.train(model, opt, range(2, 4))
    if phase == "parts":
        real = writer.write_tensors

        def first_then_stop(*args, **kwargs):
            real(*args, **kwargs)
            stop_here()

        writer.write_tensors = first_then_stop
    else:
        writer.replace_dir = stop_here
    checkpoint.save(path, model=model, dense_optimizer=opt, step=4)
    raise SystemExit("the second save was expected to stop part-way")


if __name__ == "__main__":
    main()
