"""bench/knee: knee curves (paper Fig. 2a): latency vs GPU% per batch size, and the knee GPU%.

Two parts:
- the paper-derived profiles (``gpuprims/profile/paper``; synthesised from the paper's figures, not
  measured): their knee at batch 1 and 8 (``knee()``, 10% tolerance);
- a profile measured on this machine with ``gpuprims.profile.measure`` (each point in a fresh
  process with its share applied first): MobileNetV2 at 224x224, batches 1 and 8. Without a GPU,
  GPU% is a share of CPU cores; a 2-core machine has only two levels (50% = one core, 100% = two).

Run: ``python3 -m bench.knee [--quick]``. Reports, never asserts.
"""

from __future__ import annotations

import argparse
from typing import Any

from bench.common import results_dir, write_result
from gpuprims.profile import paper_profiles
from gpuprims.profile.knee import knee
from gpuprims.profile.measure import measure_profile, plot_profile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a tiny model and few points")
    ap.add_argument("--backend", default="auto", choices=["auto", "cpu", "cuda"])
    args = ap.parse_args()

    summary: dict[str, Any] = {}
    samples: dict[str, Any] = {"paper": {}}
    for name, p in paper_profiles().items():
        summary[f"paper_{name}_knee_b1_pct"] = knee(p, 1)
        summary[f"paper_{name}_knee_b8_pct"] = knee(p, 8)
        samples["paper"][name] = {str(b): {str(g): p.point(b, g).latency_p50_ms for g in p.gpu_pcts}
                                  for b in p.batch_sizes}

    if args.quick:
        model, kw = "mobilenet", {"input_shape": (3, 32, 32), "width": 0.25, "batch_sizes": [1, 4],
                                  "gpu_pcts": [50, 100], "repeats": 5}
    else:
        # A 2-core CPU has two share levels (1 or 2 cores); a GPU gets the paper's grid.
        from gpuprims.backend import resolve_backend

        pcts = [10, 25, 50, 75, 100] if resolve_backend(args.backend) == "cuda" else [50, 100]
        model, kw = "mobilenet", {"input_shape": (3, 224, 224), "width": 1.0, "batch_sizes": [1, 8],
                                  "gpu_pcts": pcts, "repeats": 10}
    prof = measure_profile(model, backend=args.backend, progress=True, **kw)
    samples["measured"] = prof.model_dump(mode="json")
    summary["measured_model"] = model
    summary["measured_backend"] = prof.backend
    for b in prof.batch_sizes:
        summary[f"measured_knee_b{b}_pct"] = knee(prof, b)
        for g in prof.gpu_pcts:
            summary[f"measured_b{b}_pct{g}_p50_ms"] = prof.point(b, g).latency_p50_ms
    out = results_dir(prof.backend)
    plot_profile(prof, out / "knee.png")
    plot_profile(paper_profiles()["resnet50"], out / "knee_paper_resnet50.png")
    notes = ("paper_* knees come from profiles synthesised from the paper's figures (source: paper); measured_* "
             "from this machine. On CPU, GPU% is a share of cores.")
    path = write_result("knee", prof.backend, summary, samples, notes=notes)
    print(f"wrote {path}")
    for k, v in summary.items():
        if k.startswith("measured"):
            print(f"  {k}: {v}")


if __name__ == "__main__":
    main()
