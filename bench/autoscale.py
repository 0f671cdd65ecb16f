"""Auto-partitioning and mixture-driven scaling, simulated on measured costs (issue 12 closing-note figure).

1. Builds small real sources: the demo mixture's three text sources (`mixplane demo-data`, cached in
   ~/.cache/mixplane/autoscale) and a text + image-text mixture (JPEG images), and profiles every source
   with `mixplane profile`'s code (the loader's own reader and transforms).
2. Auto-partitions each mixture for a trainer rate and prints, per schedule segment, demand and supply
   per source and idle CPU; then checks every step of the schedule: supply >= demand, idle <= 10 %.
3. Runs the scaling policy through the demo's phase change (one interval = --every steps) and prints
   when each source was re-targeted.

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from mixplane.operator.autopartition import LoaderBudget, auto_partition, idle_fraction, spec_schedule  # noqa: E402
from mixplane.operator.scaling import MixtureScaler, Observation, ScalingConfig  # noqa: E402
from mixplane.profile import costs_from_profile, profile_spec  # noqa: E402
from mixplane.spec import load_spec, parse_spec  # noqa: E402


def demo_spec(cache: Path):
    from mixplane.demo.data import ensure_demo_data

    data = cache / "demo-data"
    ensure_demo_data(data, max_mb=1.0)
    text = (ROOT / "examples" / "demo.yaml").read_text().replace("../.mixplane/demo-data", str(data))
    f = cache / "demo.yaml"
    f.write_text(text)
    return load_spec(f)


def vlm_spec(cache: Path):
    from tests.unit.operator_testdata import text_image_mixture, write_text_and_images

    root = cache / "vlm"
    paths = write_text_and_images(root)
    return parse_spec(text_image_mixture(paths))


def simulate(name: str, spec, tokens_per_s: float, rows: int, budget: LoaderBudget) -> dict:
    prof = profile_spec(spec, max_rows=rows, max_cpu_s=1.0)
    costs = costs_from_profile(prof)
    sched = spec_schedule(spec, {n: p["mean_tokens_per_sample"] for n, p in prof["sources"].items()})
    plan = auto_partition(costs, sched, tokens_per_s, budget)
    print(f"\n== {name}: trainer {tokens_per_s:,.0f} tokens/s; partitions {dict(plan.partitions)}")
    for n, p in prof["sources"].items():
        print(f"   profile {n:<6} {p['kind']:<10} {p['cpu_s_per_token'] * 1e6:8.3f} us/token  {p['memory_per_partition'] / 2**20:7.1f} MiB/partition")
    print(f"{'steps':<12}{'source':<8}{'share':>7}{'demand tok/s':>15}{'supply tok/s':>15}{'cover':>7}  pods")
    last = max(s for s, _ in sched) + 100
    bounds = [s for s, _ in sched] + [last]
    min_cover, max_idle = float("inf"), 0.0
    for (start, shares), end in zip(sched, bounds[1:]):
        pods = plan.pods_at(start)
        supply = plan.supply_tokens_per_s(start)
        for n, share in shares.items():
            demand = share * tokens_per_s
            cover = supply[n] / demand if demand > 0 else float("inf")
            names = ",".join(f"{p.name}({p.cpu:g})" for p in pods.pods_of(n))
            print(f"{start:>4}-{end - 1:<7}{n:<8}{share:7.3f}{demand:15,.0f}{supply[n]:15,.0f}{min(cover, 99):7.2f}  {names}")
        demand_cores = sum(shares[c.name] * tokens_per_s * c.cpu_s_per_token for c in costs)
        print(f"{'':12}{'cpu':<8} requested {pods.cpu:.2f} cores, needed {demand_cores:.2f}, idle {100 * idle_fraction(pods, demand_cores):.1f} %")
    for step in range(last):  # every step of the schedule
        shares = [sh for s, sh in sched if s <= step][-1]
        supply = plan.supply_tokens_per_s(step)
        for n, share in shares.items():
            if share > 0:
                min_cover = min(min_cover, supply[n] / (share * tokens_per_s))
        demand_cores = sum(shares[c.name] * tokens_per_s * c.cpu_s_per_token for c in costs)
        max_idle = max(max_idle, idle_fraction(plan.pods_at(step), demand_cores))
    print(f"   every step 0..{last - 1}: min supply/demand {min_cover:.3f}, max idle CPU {100 * max_idle:.1f} %")
    return {"min_cover": round(min_cover, 4), "max_idle": round(max_idle, 4), "partitions": dict(plan.partitions),
            "pods": [len(p.pods) for _, p in plan.segments], "costs": costs, "schedule": sched, "plan": plan}


def scaling_table(sim: dict, tokens_per_s: float, every: int, k: int, lookahead: int) -> dict:
    costs, sched, plan = sim["costs"], sim["schedule"], sim["plan"]
    sc = MixtureScaler(costs, plan.partitions, sched, sched[0][1], tokens_per_s,
                       config=ScalingConfig(lookahead_steps=lookahead, window=3, consecutive=k))
    names = [c.name for c in costs]
    print(f"\n== scaling through the demo's phase change (interval = {every} steps, lookahead {lookahead}, K = {k})")
    print(f"{'int':>4}{'step':>6}  " + "".join(f"{n + ' share':>12}{n + ' cores':>12}" for n in names) + f"{'idle %':>8}  decisions")
    idle_max = 0.0
    first_seen = {}
    acted = {}
    short = 0
    for i in range(1, 18):
        step = i * every
        decided = sc.observe(Observation(step, tokens_per_s))
        shares = [sh for s, sh in sched if s <= step][-1]
        ahead = [sh for s, sh in sched if s <= step + lookahead][-1]
        for n in names:  # a rise counts from when the lookahead shows it, a fall from when it happens
            if (ahead[n] > sched[0][1][n] + 1e-9 or shares[n] < sched[0][1][n] - 1e-9) and n not in first_seen:
                first_seen[n] = i
        for d in decided:
            acted.setdefault(d.source, i)
        alloc = sc.allocated_cores()
        supply = sc.supply_tokens_per_s()
        short += sum(1 for n in names if supply[n] < shares[n] * tokens_per_s * (1 - 1e-9))
        idle = idle_fraction(sc.plan, sum(shares[c.name] * tokens_per_s * sc.costs[c.name].cpu_s_per_token for c in costs))
        idle_max = max(idle_max, idle)
        print(f"{i:>4}{step:>6}  " + "".join(f"{shares[n]:12.2f}{alloc[n]:12.2f}" for n in names) + f"{100 * idle:8.1f}  "
              + "; ".join(f"{d.source} {d.direction} {d.from_cores:.2f}->{d.to_cores:.2f}" for d in decided))
    lag = {n: acted[n] - first_seen[n] + 1 for n in acted if n in first_seen}
    print(f"   intervals from the change being visible (projected rise / actual fall) to the scaling, counting both: {lag} "
          f"(K = {k}); intervals short of supply: {short}")
    return {"lag_intervals": lag, "k": k, "short_intervals": short, "max_idle": round(idle_max, 4)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--k", type=int, default=2)
    args = ap.parse_args()
    cache = Path(os.environ.get("MIXPLANE_CACHE", Path.home() / ".cache" / "mixplane")) / "autoscale"
    cache.mkdir(parents=True, exist_ok=True)
    rows = 128 if args.quick else 1024
    demo = simulate("demo mixture (examples/demo.yaml)", demo_spec(cache), 2_000_000, rows, LoaderBudget(32, 64 << 30))
    with tempfile.TemporaryDirectory() as tmp:
        vlm = simulate("text + image-text", vlm_spec(Path(tmp)), 60_000, rows, LoaderBudget(32, 64 << 30))
    scaling = scaling_table(demo, 2_000_000, args.every, args.k, lookahead=2 * args.every)
    out = {"bench": "autoscale", "demo": {k: demo[k] for k in ("min_cover", "max_idle", "partitions", "pods")},
           "text_image": {k: vlm[k] for k in ("min_cover", "max_idle", "partitions", "pods")}, "scaling": scaling}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
