"""The one-line-per-check summary of a results JSON that benches/gpu/checks.py prints at the
end: `python3 benches/gpu/table.py RESULTS.json` prints it again for a saved run."""
import json
import sys

GB = 1e9


def table(results):
    lines = [f"# {results['device']}"]
    for key, r in results["checks"].items():
        fig = ""
        if key == "speed" and "zrun_s0_over_pytorch" in r:
            b = r["best_of_rounds"]
            fig = "  ".join(f"{k}: {v['tokens_per_s']:.0f} tok/s"
                            + (f" mfu {100 * v['mfu']:.1f}%" if v.get("mfu") else "")
                            for k, v in b.items())
            fig += f"  s0/pytorch {r['zrun_s0_over_pytorch']:.3f} s3/s0 {r.get('zrun_s3_over_s0', 0):.3f}"
            fig += f" s0/compile {r.get('zrun_s0_over_compile', 0):.3f}"
        elif key == "profile" and "tables" in r:
            fig = "  ".join(
                f"{k}: window {v['window_ms']:.0f} ms idle {v['idle_ms']:.0f} ms "
                + " ".join(f"{n} {t:.0f}" for n, t in list(v["by_kind_ms"].items())[:4])
                for k, v in r["tables"].items() if "window_ms" in v)
        elif key == "llama" and "best_of_rounds" in r:
            fig = f"micro-batch {r['micro_batch']}  " + "  ".join(
                f"{k}: {v['tokens_per_s']:.0f} tok/s" for k, v in r["best_of_rounds"].items())
            fig += f"  s0/compile {r.get('zrun_s0_over_compile', 0):.3f}"
        elif key == "8b" and r.get("steady"):
            fig = (f"{r['steady']['tokens_per_s']:.0f} tok/s mfu {100 * (r['steady']['mfu'] or 0):.1f}%  "
                   f"device est/peak {r.get('device_estimate_over_peak', 0):.3f}  "
                   f"host est/peak {r.get('host_estimate_over_peak', 0):.3f}")
        elif key in ("ranks", "cpu"):
            bad = [k for k, v in r["rows"].items() if not v["pass"]]
            worst = max((v["worst_rel_loss"] or 0) for v in r["rows"].values())
            fig = f"{len(r['rows'])} pairs, worst relative loss gap {worst:.2e}, failing {bad}"
        elif key == "offload" and "step_time_ratio" in r:
            fig = (f"step x{r['step_time_ratio']:.2f} with offload "
                   f"(x{r['step_time_ratio_overlapped']:.2f} overlapped, grad_clip 0), "
                   f"{r['device_bytes_saved'] / GB:.2f} GB less on the GPU")
        elif key == "memory":
            fig = "  ".join(
                f"{k}: est/alloc {v['ranks'][0]['estimate_over_allocated']:.3f} "
                f"alloc {v['ranks'][0]['max_memory_allocated'] / GB:.2f} GB"
                for k, v in r["rows"].items() if v.get("ranks"))
        elif key == "oom":
            fig = f"exit {r['rc']} after {r['exit_after_s']} s, found {r['found']}"
        elif key == "limit" and "shrinks" in r:
            fig = (f"peak {r['cuda_allocated_peak'] / GB:.2f} GB under {r['limit'] / GB:.2f} GB, "
                   f"micro-batch {r['shrinks'][0].get('from') if r['shrinks'] else '?'} -> "
                   f"{r['final_micro_batch']}")
        elif key == "nccl_hybrid" and "rows" in r:
            worst = max((x["worst_rel_loss"] or 0) for x in r["rows"].values())
            fig = f"{len(r['rows'])} pairs, worst relative loss gap {worst:.2e}"
        elif key == "nccl_ranks" and "rows" in r:
            worst = max((x["worst_rel_loss"] or 0) for x in r["rows"].values())
            wrong = sum(x["wrong"] for x in r.get("comm_rows", []))
            fig = f"{len(r['rows'])} pairs, worst relative loss gap {worst:.2e}, comm wrong {wrong}"
        elif key == "delay" and "delayed_over_bound" in r:
            fig = (f"delayed step x{r['delayed_over_bound']:.2f}, split "
                   f"x{r.get('fresh_over_bound', float('nan')):.2f}"
                   + (f" (copies in line x{r['fresh_in_line_over_bound']:.2f})"
                      if "fresh_in_line_over_bound" in r else "")
                   + (f" (read in line x{r['fresh_read_in_line_over_bound']:.2f})"
                      if "fresh_read_in_line_over_bound" in r else "")
                   + " of max(no offload, CPU AdamW), "
                   + (f"split's loss gap {r['loss_gap']:.2%}" if r.get("loss_gap") is not None
                      else "loss gap not measured (check K)"))
        elif key == "delay_loss" and "by_lr" in r:
            fig = "  ".join(f"lr {lr}: loss {v['loss_last10']['offload']:.3f} undelayed, "
                            + ", ".join(f"{v['loss_last10'][k]:.3f} {k.replace('offload ', '')} "
                                        f"(gap {g:.1%})" for k, g in v["loss_gaps"].items())
                            for lr, v in r["by_lr"].items())
        elif key == "nccl_kill":
            fig = f"exit {r.get('rc')} {r.get('exit_after_kill_s')} s after the kill, named {r.get('named')}"
        elif key == "ext" and "tests" in r:
            fig = f"{r['tests']} tests, failing {r['failed']}"
        elif key == "nccl":
            fig = f"{len(r.get('rows', []))} rows, wrong {sum(x['wrong'] for x in r.get('rows', []))}"
        lines.append(f"{key:8} {'PASS' if r.get('pass') else 'FAIL'}  {fig}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(json.load(open(sys.argv[1]))))
