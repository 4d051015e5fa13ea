"""ddp's gradient all-reduce (astuner/trainer/data_parallel.py): bucketed in the gradients' own dtype, never one flat
fp32 copy of every gradient (up to 8 bytes a parameter beyond the memory plan); the sums are the workers' sums."""

from __future__ import annotations

import torch
import torch.multiprocessing as mp

from astuner.trainer.data_parallel import grad_buckets

BUCKET = 64  # bytes: small enough that the test's tensors need several buckets


def test_buckets_hold_one_dtype_and_at_most_the_cap():
    grads = [torch.zeros(10), torch.zeros(20), torch.zeros(5), torch.zeros(8, dtype=torch.bfloat16),
             torch.zeros(100), torch.zeros(2)]
    # 40 + 80 bytes fill 120; 20 more would pass it; bf16 starts its own; 400 bytes go alone; then a new one
    assert grad_buckets(grads, 120) == [[0, 1], [2], [3], [4], [5]]
    assert grad_buckets(grads, 10**6) == [[0, 1, 2], [3], [4, 5]]


def worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from astuner.trainer.data_parallel import DataParallel

    dp = DataParallel.init(rank, world, "127.0.0.1", port, "cpu", 60.0)
    seen = []
    reduce = dist.all_reduce

    def spy(tensor, *args, **kwargs):  # what went over the wire: dtype and bytes of each collective
        seen.append((tensor.dtype, tensor.numel() * tensor.element_size()))
        return reduce(tensor, *args, **kwargs)

    dist.all_reduce = spy
    params = [torch.zeros(3, 4), torch.zeros(5, dtype=torch.bfloat16), torch.zeros(1000), torch.zeros(2),
              torch.zeros(3)]
    for i, p in enumerate(params[:4]):
        p.grad = torch.arange(p.numel(), dtype=p.dtype).reshape(p.shape) * (rank + 1) + i
    # params[4] has no gradient on this worker (a branch it did not run): zeros
    dp.all_reduce_grads(params, bucket_bytes=BUCKET)
    torch.save({"grads": [p.grad for p in params], "seen": seen}, f"{out}.{rank}")
    DataParallel.close()


def test_two_workers_sum_in_each_gradients_dtype_bucket_by_bucket(tmp_path):
    from astuner.trainer.data_parallel import free_port

    out = str(tmp_path / "reduced")
    mp.start_processes(worker, args=(2, free_port("127.0.0.1"), out), nprocs=2, start_method="spawn")
    results = [torch.load(f"{out}.{r}") for r in range(2)]
    shapes = [(3, 4), (5,), (1000,), (2,), (3,)]
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.float32, torch.float32]
    for r in results:
        for i, (grad, shape, dtype) in enumerate(zip(r["grads"], shapes, dtypes)):
            assert grad.dtype == dtype and tuple(grad.shape) == shape
            n = grad.numel()
            expected = torch.zeros(n) if i == 4 else torch.arange(n, dtype=torch.float32) * 3 + 2 * i  # (1 + 2) x
            # small integers: exact in bf16 too
            assert torch.equal(grad.reshape(-1).float(), expected), i
        # every collective in a gradient's own dtype, each at most a bucket unless one gradient alone
        assert {dtype for dtype, _ in r["seen"]} == {torch.float32, torch.bfloat16}
        assert all(nbytes <= BUCKET or nbytes == 4000 for _, nbytes in r["seen"]), r["seen"]
        assert sum(nbytes for _, nbytes in r["seen"]) == 48 + 10 + 4000 + 8 + 12
