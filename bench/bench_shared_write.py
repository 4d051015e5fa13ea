"""Peak extra host memory of a weight sync's write into the shared-memory file (astuner/engine/shared_weights.py).

A model's worth of fp32 tensors is produced one at a time by a generator, as the trainer's
`named_parameters_for_sync` gathers them, and written with `SharedWeightFile.write`:
  streamed  the generator itself: each tensor is dropped once it is in the file;
  held      a list of every tensor first: what the write did before it streamed (all tensors alive at once).
Each mode runs in a fresh process and measures a sync after the first (the file's layout known): the peak
resident memory during the write (the kernel's high-water mark, reset just before it) minus the resident memory
before it and minus the file's pages it mapped (RssShmem: a mapping of /dev/shm counts in RSS), i.e. what the
write needs beside its file. glibc is told to map every large
block of its own (MALLOC_MMAP_THRESHOLD_), so a freed tensor leaves the resident set at once.

    .venv/bin/python bench/bench_shared_write.py [--total-mb 200] [--tensor-mb 8]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = """
import gc, json, os, sys
import torch
from astuner.engine.shared_weights import SharedWeightFile

mode, total, each = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
elements = each // 4

def gathered():
    for i in range(total // each):
        yield f"layer{i}.weight", torch.randn(elements)

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

shared = SharedWeightFile("float32")
shared.write(gathered())  # the first sync: sizes the file and maps it; the fingerprint's sign pattern is cached
gc.collect()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak (VmHWM) to the current RSS
before, shmem = status("VmRSS"), status("RssShmem")
path, manifest = shared.write(gathered() if mode == "streamed" else list(gathered()))
file_pages = status("RssShmem") - shmem
print(json.dumps({"mode": mode, "extra_mib": (status("VmHWM") - before - file_pages) / 2**20,
                  "file_mib": os.path.getsize(path) / 2**20}))
shared.close()
"""


def measure(mode: str, total: int, each: int) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(1 << 20))
    out = subprocess.run([sys.executable, "-c", CHILD, mode, str(total), str(each)], capture_output=True, text=True,
                         timeout=600, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--total-mb", type=int, default=200, help="bytes of fp32 tensors written, in MiB")
    parser.add_argument("--tensor-mb", type=int, default=8, help="bytes of each tensor, in MiB")
    args = parser.parse_args()
    total, each = args.total_mb << 20, args.tensor_mb << 20
    print(f"write of {total >> 20} MiB of fp32 tensors, {each >> 20} MiB each, produced one at a time")
    for mode in ("held", "streamed"):
        r = measure(mode, total, each)
        print(f"  {mode:9s} peak extra host memory {r['extra_mib']:7.1f} MiB beside the {r['file_mib']:.0f} MiB "
              "file")


if __name__ == "__main__":
    main()
