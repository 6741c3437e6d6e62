"""The plan's ceiling and forecast against each level a rehearsal measured (on-h200-reach.sh's runs):

    python3 docs/examples/h200-vllm/reach.py docs/examples/h200-vllm/run-reach

For each run folder under the argument: the share of the bandwidth ceiling every level reached, and the forecast's
error there (the forecast is capped at sizing.FORECAST_CEILING_REACH of the ceiling).
"""

import json
import sys
from pathlib import Path

for plan_file in sorted(Path(sys.argv[1]).rglob("01_plan.json")):
    run = plan_file.parent
    plan = json.loads(plan_file.read_text())
    rehearsal = json.loads((run / "02_rehearse.json").read_text())
    candidate = rehearsal["candidates"][0]
    layout = next(lay for lay in plan["layouts"] if lay["name"] == candidate["name"].split(" ")[0])
    print(
        f"{run.name}: {candidate['name']}, {layout['weight_bytes_per_gpu'] / 1e9:.1f} GB of weights, "
        f"KV tokens {candidate['kv_cache_tokens']:,} (plan {candidate['predicted_kv_tokens']:,})"
    )
    if not layout["decode_ceiling"]:
        print("  no bandwidth ceiling: a CPU plan")
        continue
    print("  streams  measured  ceiling  reached  forecast  error")
    for point in candidate["points"]:
        c, measured = point["concurrency"], point["output_tok_s"]
        ceiling, forecast = layout["decode_ceiling"][str(c)], layout["forecast"][str(c)]
        print(
            f"  {c:7d}  {measured:8,.0f}  {ceiling:7,.0f}  {measured / ceiling:7.2f}  {forecast:8,.0f}  "
            f"{forecast / measured - 1:+6.0%}"
        )
