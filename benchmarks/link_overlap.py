"""Does the host-device link overlap with compute? zero_lab.host_link.Link's copies against matmuls, on one GPU.

    python benchmarks/link_overlap.py [--size-mb 256] [--copies 5] [--matmuls 20] [--n 8192] [--repeats 5]

On CUDA it times (wall clock between two torch.cuda.synchronize(), the best of --repeats after a warm-up):
--matmuls bf16 n x n matmuls alone; --copies uploads of --size-mb MiB (Link.to_device, pinned host ->
device) alone; as many downloads (Link.to_host, device -> pinned host) alone; and the matmuls interleaved
with the uploads, and with the downloads (a copy queued after each --matmuls / --copies matmuls). The
copies' sources and destinations are not the matmuls', so each copy is given `after=` an event recorded
before the matmuls: the link should run it beside them. The overlap ratio is interleaved / max(alone):
1.0 is full overlap, (a + b) / max(a, b) none. It also times plain copies (one stream) of the same size,
pinned and pageable, each way. Without a GPU it says so in one line and exits 0.

From another script: measure_link(size_mb=256, device="cuda", ...) -> dict of the same figures.
"""

from __future__ import annotations

import argparse
import time

import torch

from zero_lab.host_link import Link

MIB = 2**20


def _best_ms(work, repeats: int) -> float:
    """The fastest of `repeats` runs of work() (after one warm-up run), in ms, device work included."""
    times = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        work()
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - start))
    return min(times[1:])


def measure_link(size_mb: int = 256, device: str = "cuda", copies: int = 5, matmuls: int = 20, n: int = 8192,
                 repeats: int = 5) -> dict:
    """Times of matmuls, uploads and downloads through a Link, alone and interleaved, and the bandwidth of
    plain copies; see the module's docstring. Needs a CUDA device."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise RuntimeError(f"measure_link needs a CUDA device, got {device} (CUDA available: {torch.cuda.is_available()})")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(device)
    link = Link(device)
    numel = size_mb * MIB // 2  # bf16
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    product = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    host = [link.host_zeros(numel, torch.bfloat16) for _ in range(copies)]  # pinned
    on_device = [torch.zeros(numel, device=device, dtype=torch.bfloat16) for _ in range(copies)]
    per_copy = max(1, matmuls // copies)

    def run(with_matmuls: bool, direction: str | None):
        free = link.mark()  # nothing queued after this reads or writes the copies' tensors
        transfers = []
        for i in range(copies if direction else 0):
            if with_matmuls:
                for _ in range(per_copy):
                    torch.matmul(a, b, out=product)
            if direction == "up":
                transfers.append(link.to_device(on_device[i], host[i], after=free))
            else:
                transfers.append(link.to_host(on_device[i], after=free))
        if not direction:
            for _ in range(per_copy * copies):
                torch.matmul(a, b, out=product)
        for transfer in transfers:
            transfer.device_wait()  # the compute stream ends after the copies (the synchronize waits for all)

    ms = {name: _best_ms(lambda: run(*how), repeats) for name, how in {
        "matmuls": (True, None), "uploads": (False, "up"), "downloads": (False, "down"),
        "matmuls + uploads": (True, "up"), "matmuls + downloads": (True, "down")}.items()}
    overlap = {kind: ms[f"matmuls + {kind}"] / max(ms["matmuls"], ms[kind]) for kind in ("uploads", "downloads")}
    serial = {kind: (ms["matmuls"] + ms[kind]) / max(ms["matmuls"], ms[kind]) for kind in ("uploads", "downloads")}

    pageable = torch.zeros(numel, dtype=torch.bfloat16)
    bandwidth = {}
    for kind, host_tensor in (("pinned", host[0]), ("pageable", pageable)):
        for way, (destination, source) in (("up", (on_device[0], host_tensor)), ("down", (host_tensor, on_device[0]))):
            seconds = _best_ms(lambda: destination.copy_(source, non_blocking=True), repeats) / 1e3
            bandwidth[f"{kind} {way}"] = numel * 2 / seconds / 1e9
    return {"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "size_mb": size_mb,
            "copies": copies, "matmuls": per_copy * copies, "n": n, "ms": ms, "overlap": overlap, "serial": serial,
            "GB/s": bandwidth}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=256)
    parser.add_argument("--copies", type=int, default=5)
    parser.add_argument("--matmuls", type=int, default=20)
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("link_overlap: needs a CUDA GPU, and this machine has none; nothing measured.")
        return 0
    r = measure_link(args.size_mb, "cuda", args.copies, args.matmuls, args.n, args.repeats)
    print(f"{r['device']}, torch {r['torch']}: {r['matmuls']} bf16 {r['n']}x{r['n']} matmuls; "
          f"{r['copies']} copies of {r['size_mb']} MiB bf16 through zero_lab.host_link.Link (best of {args.repeats})")
    print(f"{'run':>20} {'ms':>8} {'overlap':>8} {'if serial':>9}")
    for name, value in r["ms"].items():
        kind = name.removeprefix("matmuls + ")
        ratios = f"{r['overlap'][kind]:8.2f} {r['serial'][kind]:9.2f}" if "+" in name else ""
        print(f"{name:>20} {value:8.1f} {ratios}")
    print("overlap = interleaved / max(alone): 1.00 is full overlap, 'if serial' none")
    print("plain copies, one stream, GB/s: " + ", ".join(f"{k} {v:.1f}" for k, v in r["GB/s"].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
