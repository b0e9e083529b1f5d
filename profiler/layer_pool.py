"""Per-layer work of the profile run on a pool of single-threaded torch workers.

Layers' predictor training and input-sparsity allocation are independent of each other and made
of many small torch ops. On 2 threads such ops spend most of their time at OpenMP barriers (10x
slower per op on a busy 2-core machine), so each worker runs torch on one thread and the layers
run side by side instead."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch


def in_parallel(jobs: list, prepare: Callable, work: Callable, done: Callable[[int], None] | None = None,
                device: str | torch.device = "cpu", most_workers: int | None = None) -> None:
    """prepare(job) in this thread (it may run the model's numba kernels, which are not to be called
    from two threads at once), then work(i, *prepared) on a pool of one worker per torch thread
    (at most most_workers), each in inference mode or not as this thread is, with torch
    single-threaded; done(count) after each job. A GPU runs one job at a time. At most workers + 1
    jobs' prepared data are held at once. The first exception of a job is raised here."""
    threads = torch.get_num_threads()
    workers = 1 if torch.device(device).type == "cuda" else max(1, min(threads, most_workers or threads))
    slots = threading.Semaphore(workers + 1)
    count = [0]
    lock = threading.Lock()
    inference = torch.is_inference_mode_enabled()
    grad = torch.is_grad_enabled()

    def run(i, prepared):
        try:  # grad and inference mode are per thread: the caller's, in the worker too
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                work(i, *prepared)
        finally:
            slots.release()
        with lock:
            count[0] += 1
            if done is not None:
                done(count[0])

    if workers > 1:
        torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(workers) as pool:
            futures = []
            for i, job in enumerate(jobs):
                slots.acquire()
                futures.append(pool.submit(run, i, prepare(job)))
            for f in futures:
                f.result()
    finally:
        torch.set_num_threads(threads)
