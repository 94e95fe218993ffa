"""Steps under the JAX profiler: the device's events per step, and the last step's streams (busy time, idle gaps)."""

from __future__ import annotations

PROFILE_STEPS = 3
PROFILE_TOP = 30  # events kept per step in a row's profile


def stream_summary(events: list[dict]) -> dict:
    """One step's events (`profile_ep.last_step_timeline`'s, of one device): each stream's busy milliseconds, and
    the busiest stream's idle time inside the step with its longest gaps (the event before and after each)."""
    busy: dict[str, float] = {}
    for event in events:
        busy[event["stream"]] = busy.get(event["stream"], 0.0) + event["dur_us"] / 1e3
    if not events:
        return dict(streams={})
    main = max(busy, key=busy.__getitem__)
    gaps, end, previous = [], None, None
    for event in (e for e in events if e["stream"] == main):
        if end is not None and event["start_us"] > end:
            gaps.append(dict(us=round(event["start_us"] - end, 1), after=previous, before=event["name"]))
        end = max(end or 0.0, event["start_us"] + event["dur_us"])
        previous = event["name"]
    span = max(e["start_us"] + e["dur_us"] for e in events) - min(e["start_us"] for e in events)
    return dict(
        streams={name: round(ms, 3) for name, ms in sorted(busy.items(), key=lambda item: -item[1])},
        step_span_ms=round(span / 1e3, 3),
        busiest=main,
        idle_ms=round(sum(g["us"] for g in gaps) / 1e3, 3),
        longest_gaps=sorted(gaps, key=lambda g: -g["us"])[:10],
    )


def profile_steps(run_step, sync, out_dir: str, on_gpu: bool) -> dict:
    """`PROFILE_STEPS` steps under the JAX profiler (trace in `out_dir`): the device's events per step, and the last
    step's streams (`stream_summary`). On a CPU the host's XLA threads stand in for the device."""
    from pathlib import Path

    import jax

    from benchmarks import profile_ep

    with jax.profiler.trace(out_dir, create_perfetto_trace=True):
        for _ in range(PROFILE_STEPS):
            sync(run_step())
    trace = profile_ep.latest_trace(Path(out_dir))
    process = profile_ep.DEVICE_PROCESS if on_gpu else r"^/host:CPU"
    per_step = profile_ep.per_step(profile_ep.kernel_times(trace, process), PROFILE_STEPS)
    timeline = profile_ep.last_step_timeline(trace, process, PROFILE_STEPS)
    return {
        name: dict(
            events_ms=summary["total_ms"],
            top=[dict(e, ms=round(e["ms"], 4)) for e in summary["events"][:PROFILE_TOP]],
            last_step=stream_summary(timeline.get(name, [])),
        )
        for name, summary in per_step.items()
    }
