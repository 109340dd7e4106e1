"""The serving bench's figures a device run prints at its end (run_checks.sh, run_bench.sh): per stage named
on the command line, the JSON last line its bench left in $OUT/<stage>.json."""

import json
import os
import sys

for name in sys.argv[1:]:
    try:
        doc = json.loads(open(os.path.join(os.environ.get("OUT", "/tmp/out"), name + ".json")).read())
    except Exception as exc:  # noqa: BLE001 - a stage cut off by its timeout left no JSON: say so, go on
        print(name, "no JSON:", exc)
        continue
    print(name, "goals", doc.get("goals"), "cores", doc.get("cores"), "load", doc.get("load_generator_pinned_to"),
          "server", doc.get("server_pinned_to"))
    print(" best over triton", json.dumps(doc.get("best_workers_over_triton")))
    print(" growth", json.dumps(doc.get("workers_over_workers1")))
    for w, per in doc.get("ratio", {}).items():
        print(" ", w, {k: (v["throughput"], v["cpu_per_inference"]) for k, v in per.items()})
    for w, per in doc.get("figures", {}).items():
        merged = {k: (v["coalesced_share"], v["coalesced_mean"]) for k, v in per.items() if "coalesced_mean" in v}
        if merged:
            print("  coalesced", w, merged)
