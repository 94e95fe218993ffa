"""Where the time of one `moe_ffn_ep` step goes, per GPU and per kernel, from a JAX profiler trace.

Nsight Compute serialises kernel launches across a process's GPUs, which deadlocks every kernel that
waits on a peer (the nvlink transport's and NCCL's), and Nsight Systems is not installed everywhere;
the JAX profiler (CUPTI) records every kernel with its real duration and concurrency. This
script runs the forward+backward of `moe_ffn_ep` (bench_ep's inputs and transports; `--ep N` GPUs of
this process, or `--emulate R` shards on one GPU) `--iters` times inside `jax.profiler.trace`, reads
the Perfetto trace the profiler writes, and sums the duration of the complete events of each device
process per event name. It also lays out the last step's events on each device in time (stream, start,
duration), which shows what runs beside what and what waits: the sums alone do not give the critical path.
Prints the top kernels and the last step per device and writes OUT_DIR/profile_ep.json; the trace itself
stays in OUT_DIR for Perfetto.

Usage: python -m benchmarks.profile_ep OUT_DIR [--config q30] [--ep 2 | --emulate R] [--transport xla]
                                       [--iters 5] [--top 25] [--process REGEX]
"""

from __future__ import annotations

import collections
import functools
import gzip
import json
import re
from pathlib import Path

from jax_megamoe import cli  # the command-line jobs' exit-code rule

DEVICE_PROCESS = r"^/device:GPU:\d+"  # the profiler's process names for GPU activity


def kernel_times(trace: dict, process_pattern: str) -> dict[str, dict[str, dict[str, float]]]:
    """`{process name: {event name: {"total_us", "count"}}}` over the complete ("X") events of the
    processes whose name matches `process_pattern`."""
    names = {
        e["pid"]: e["args"]["name"]
        for e in trace["traceEvents"]
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    wanted = {pid for pid, name in names.items() if re.search(process_pattern, name)}
    times: dict = collections.defaultdict(lambda: collections.defaultdict(lambda: {"total_us": 0.0, "count": 0}))
    for event in trace["traceEvents"]:
        if event.get("ph") == "X" and event.get("pid") in wanted:
            entry = times[names[event["pid"]]][event["name"]]
            entry["total_us"] += float(event.get("dur", 0.0))
            entry["count"] += 1
    return {process: dict(events) for process, events in times.items()}


def last_step_timeline(trace: dict, process_pattern: str, iters: int) -> dict[str, list[dict]]:
    """`{process name: [{"stream", "start_us", "dur_us", "name"}]}`: the complete events of the last of `iters`
    steps on each matching process, by start time, relative to the step's first event. The steps are told apart
    by the `iters - 1` longest idle gaps of the process (the host waits for each step before the next)."""
    names = {
        e["pid"]: e["args"]["name"]
        for e in trace["traceEvents"]
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in trace["traceEvents"]
        if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    events = collections.defaultdict(list)
    for event in trace["traceEvents"]:
        if event.get("ph") == "X" and re.search(process_pattern, names.get(event.get("pid"), "")):
            events[event["pid"]].append(event)
    out = {}
    for pid, process_events in sorted(events.items(), key=lambda item: names[item[0]]):
        process_events.sort(key=lambda e: float(e["ts"]))
        gaps, busy_until = [], float("-inf")
        for index, event in enumerate(process_events):
            start = float(event["ts"])
            if index:
                gaps.append((start - busy_until, index))
            busy_until = max(busy_until, start + float(event.get("dur", 0.0)))
        starts = sorted(index for _, index in sorted(gaps, reverse=True)[: iters - 1])
        step = process_events[starts[-1] if starts else 0 :]
        origin = float(step[0]["ts"])
        out[names[pid]] = [
            {
                "stream": threads.get((pid, e["tid"]), str(e["tid"])),
                "start_us": round(float(e["ts"]) - origin, 1),
                "dur_us": round(float(e.get("dur", 0.0)), 1),
                "name": e["name"],
            }
            for e in step
        ]
    return out


def per_step(times: dict, iters: int) -> dict:
    """Per-step milliseconds and calls, sorted by time, and each process's total."""
    out = {}
    for process, events in sorted(times.items()):
        rows = sorted(
            (
                {"name": name, "ms": e["total_us"] / iters / 1e3, "calls": e["count"] / iters}
                for name, e in events.items()
            ),
            key=lambda row: -row["ms"],
        )
        out[process] = {"total_ms": sum(row["ms"] for row in rows), "events": rows}
    return out


def latest_trace(out_dir: Path) -> dict:
    paths = sorted(out_dir.glob("plugins/profile/*/perfetto_trace.json.gz"))
    if not paths:
        raise cli.RunError(f"no perfetto_trace.json.gz under {out_dir}/plugins/profile: did the profiler run?")
    with gzip.open(paths[-1]) as f:
        return json.load(f)


def main(argv=None):
    parser = cli.Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path, help="where the trace and profile_ep.json go")
    parser.add_argument("--config", default="q30")
    parser.add_argument("--ep", type=int, default=1, help="GPUs of the expert axis")
    parser.add_argument("--emulate", type=int, metavar="R", help="R emulated shards on one device instead")
    parser.add_argument("--transport", default="xla", choices=("xla", "ragged", "nvlink"))
    parser.add_argument("--routing", default="uniform", choices=("uniform", "zipf"))
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--top", type=int, default=25, help="events printed per device")
    parser.add_argument(
        "--process", default=DEVICE_PROCESS, help="regex of the trace processes to sum (default: the GPUs)"
    )
    opts = parser.parse_args(argv)
    if opts.emulate is not None and opts.ep != 1:
        parser.error(f"--emulate R and --ep N exclude each other (got --emulate {opts.emulate}, --ep {opts.ep})")

    import jax

    import jax_megamoe as jmm
    from benchmarks.bench_ep import CONFIGS, ep_options, ep_problem, forward_backward

    if opts.config not in CONFIGS:
        parser.error(f"--config must be one of {sorted(CONFIGS)}, got {opts.config!r}")
    ranks = opts.emulate or opts.ep
    args, dy, over_axis, open_workspace = ep_problem(opts.config, ranks, opts.emulate is not None, opts.routing)

    opts.out_dir.mkdir(parents=True, exist_ok=True)
    with ep_options(opts.transport, open_workspace) as options:
        step = jax.jit(forward_backward(over_axis(functools.partial(jmm.moe_ffn_ep, axis_name="expert", **options))))
        for _ in range(3):  # compile and warm up outside the trace
            jax.block_until_ready(step(args, dy))
        with jax.profiler.trace(str(opts.out_dir), create_perfetto_trace=True):
            for _ in range(opts.iters):
                jax.block_until_ready(step(args, dy))

    trace = latest_trace(opts.out_dir)
    profile = per_step(kernel_times(trace, opts.process), opts.iters)
    if not profile:
        raise cli.UsageError(f"no complete events in trace processes matching --process {opts.process!r}: pass another")
    timeline = last_step_timeline(trace, opts.process, opts.iters)
    for process, summary in profile.items():
        print(f"{process}: {summary['total_ms']:.3f} ms of events per step (overlapping streams add up)")
        for row in summary["events"][: opts.top]:
            print(f"  {row['ms']:8.3f} ms  {row['calls']:5.1f}x  {row['name'][:110]}")
    for process, events in timeline.items():
        print(f"{process}: the last step, {len(events)} events (start and duration in us, stream)")
        for event in events:
            print(f"  {event['start_us']:9.1f} {event['dur_us']:8.1f}  {event['stream'][:24]:24}  {event['name'][:80]}")
    result = {
        "config": opts.config,
        "ranks": ranks,
        "emulated": opts.emulate is not None,
        "transport": opts.transport,
        "routing": opts.routing,
        "iters": opts.iters,
        "device": jax.devices()[0].device_kind,
        "per_step": profile,
        "last_step": timeline,
    }
    (opts.out_dir / "profile_ep.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {opts.out_dir / 'profile_ep.json'}")


if __name__ == "__main__":
    cli.run(main)
