"""What do the per-array checksums cost, next to the save and the restore they guard?

A state of ``--arrays`` float32 arrays (``--mb`` MB in all) sharded over a 2x4 mesh of
8 emulated CPU devices is saved with ``meshplan.Checkpointer(async_save=False)`` and
restored with ``meshplan.restore`` onto the same mesh, ``--repeats`` times. Reports
the medians of: the checksums alone (``array_checksums`` of the state: what a save
adds, and what a restore adds over the arrays it read), a whole save, and a whole
restore; and the ratios checksum/save and checksum/restore.

    .venv/bin/python benchmarks/bench_checksum.py              # 64 MB, 20 arrays
    .venv/bin/python benchmarks/bench_checksum.py --mb 256 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np

import meshplan
from meshplan._checkpoint.checksum import array_checksums


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=64, help="state size in MB (default 64)")
    parser.add_argument("--arrays", type=int, default=20, help="arrays in the state (default 20)")
    parser.add_argument("--repeats", type=int, default=7, help="runs of each (default 7)")
    args = parser.parse_args()

    mesh = jax.make_mesh((2, 4), ("data", "model"))
    sharding = jax.NamedSharding(mesh, jax.P("data", "model"))
    rows = max(8, (args.mb * 2**20 // 4 // args.arrays // 1024) // 8 * 8)
    keys = jax.random.split(jax.random.key(0), args.arrays)
    state = {
        f"w{i}": jax.device_put(jax.random.normal(keys[i], (rows, 1024)), sharding)
        for i in range(args.arrays)
    }
    total = sum(x.nbytes for x in state.values())
    array_checksums(state)  # compile once

    sums, saves, restores = [], [], []
    for _ in range(args.repeats):
        t = time.perf_counter()
        array_checksums(state)
        sums.append(time.perf_counter() - t)
        with tempfile.TemporaryDirectory() as folder:
            with meshplan.Checkpointer(folder, async_save=False) as ckpt:
                t = time.perf_counter()
                ckpt.save(1, state)
                saves.append(time.perf_counter() - t)
            t = time.perf_counter()
            restored = meshplan.restore(folder, mesh, step=1)
            jax.block_until_ready(restored.state)
            restores.append(time.perf_counter() - t)
    np.testing.assert_array_equal(restored.state["w0"], state["w0"])

    s, w, r = (statistics.median(x) for x in (sums, saves, restores))
    print(
        f"state: {args.arrays} float32 arrays, {total / 2**20:.0f} MB, on a 2x4 mesh (8 CPU devices)"
    )
    print(
        f"checksums (median of {args.repeats}): {s * 1e3:8.1f} ms  ({total / s / 2**30:.2f} GiB/s)"
    )
    print(f"save, with them:                 {w * 1e3:8.1f} ms  checksum/save    = {s / w:.2f}")
    print(f"restore, verifying them:         {r * 1e3:8.1f} ms  checksum/restore = {s / r:.2f}")


if __name__ == "__main__":
    main()
