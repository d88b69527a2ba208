"""The report of ``bench_gpu.py``: medians (with min/max) of every method's rounds, the
ratios to the pinned D2H copy, DCP's best stager and the raw disk, the targets of issue 31,
and the tables printed at the end of a run."""

from __future__ import annotations

import statistics
from typing import Any, Dict, List, Optional

ASYNC = ("d2h", "auto", "stream", "copy", "fork", "dcp_default", "dcp_best")
OURS = ("auto", "stream", "copy", "fork")
PINNED = ("stream_pinned", "fork_pinned")
SYNC = ("ours", "dcp", "raw")
STAGED_VS_D2H = 1.2
PINNED_GROWTH, PINNED_SLACK_S = 1.2, 0.001
MiB = 1 << 20


def stats(values: List[float]) -> Optional[Dict[str, float]]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else None


def summarize(raw: Dict[str, Any], dry_run: bool) -> Dict[str, Any]:
    """Medians (with min/max), ratios and the targets."""
    rounds = raw["rounds"]
    med: Dict[str, Dict[str, Any]] = {}
    for m, rs in rounds.items():
        fields = ("save_s", "load_s") if m in SYNC else ("blocking_s", "staged_s", "total_s")
        med[m] = {f: stats([r[f] for r in rs]) for f in fields}
        if m not in SYNC:
            med[m]["device_extra_mib_max"] = max((r["device_extra_mib"] for r in rs), default=None)
            names = sorted({name for r in rs for name in r.get("save_phases_s", {})})
            med[m]["save_phases_s"] = {n: statistics.median(r["save_phases_s"].get(n, 0.0) for r in rs) for n in names}
        med[m]["rounds"] = len(rs)

    def m_of(method: str, field: str) -> Optional[float]:
        s = med.get(method, {}).get(field)
        return s["median"] if s else None

    def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
        return a / b if a is not None and b else None

    floor, best = m_of("d2h", "staged_s"), m_of("dcp_best", "blocking_s")
    ratios = {m: {"blocking/d2h": ratio(m_of(m, "blocking_s"), floor), "staged/d2h": ratio(m_of(m, "staged_s"), floor),
                  "blocking/dcp_best": ratio(m_of(m, "blocking_s"), best)}
              for m in (*ASYNC, *PINNED) if m in med}
    ratios.update({m: {"save/raw": ratio(m_of(m, "save_s"), m_of("raw", "save_s")),
                       "load/raw": ratio(m_of(m, "load_s"), m_of("raw", "load_s")),
                       "save/dcp": ratio(m_of(m, "save_s"), m_of("dcp", "save_s")),
                       "load/dcp": ratio(m_of(m, "load_s"), m_of("dcp", "load_s"))} for m in SYNC})
    bound = raw["state"]["largest_tensor_bytes"] / MiB
    stream, pinned = m_of("stream", "blocking_s"), m_of("stream_pinned", "blocking_s")
    targets = {
        "blocking(auto) <= blocking(dcp_best)": None if best is None else m_of("auto", "blocking_s") <= best,
        f"staged(auto) <= {STAGED_VS_D2H} x d2h": m_of("auto", "staged_s") <= STAGED_VS_D2H * floor,
        "bit-exact (auto, stream, copy, fork)": all(v["bit_exact"] for v in raw["bit_exact"].values()),
        f"blocking(stream) with pinned memory <= {PINNED_GROWTH} x without + 1 ms":
            pinned <= PINNED_GROWTH * stream + PINNED_SLACK_S,
        "device memory(auto, stream) <= largest tensor":
            max(med[m]["device_extra_mib_max"] for m in ("auto", "stream")) <= bound,
        "sync verified (ours, dcp, raw)": all(rounds[m][0]["verified"] for m in SYNC),
    }
    return {"medians": med, "ratios": ratios, "targets": targets,
            "targets_not_judged": "dry run: CPU tensors, tiny state" if dry_run else None}


def cell(s: Optional[Dict[str, float]], digits: int = 4) -> str:
    return "n/a" if s is None else f"{s['median']:.{digits}f} [{s['min']:.{digits}f}–{s['max']:.{digits}f}]"


def num(x: Optional[float], digits: int = 2) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def table(raw: Dict[str, Any], summary: Dict[str, Any]) -> str:
    med, ratios = summary["medians"], summary["ratios"]
    lines = ["| async (seconds: median [min–max]) | blocking | staged | total | blocking / d2h | staged / d2h | "
             "blocking / dcp_best | device extra MiB (max) | bit-exact |", "|" + " --- |" * 9]
    for m in (*ASYNC, *PINNED):
        if m not in med:
            lines.append(f"| {m} | n/a (not in this torch) | | | | | | | |")
            continue
        r = ratios[m]
        exact = raw["bit_exact"].get(m, {}).get("bit_exact", "")
        lines.append(f"| {m} | {cell(med[m]['blocking_s'])} | {cell(med[m]['staged_s'])} | "
                     f"{cell(med[m]['total_s'], 3)} | "
                     f"{num(r['blocking/d2h'])} | {num(r['staged/d2h'])} | {num(r['blocking/dcp_best'])} | "
                     f"{num(med[m]['device_extra_mib_max'], 1)} | {exact} |")
    lines += ["", "| sync (seconds: median [min–max]) | save | load | save / raw | load / raw | save / dcp | "
              "load / dcp | verified |",
              "|" + " --- |" * 8]
    for m in SYNC:
        r = ratios[m]
        lines.append(f"| {m} | {cell(med[m]['save_s'], 3)} | {cell(med[m]['load_s'], 3)} | {num(r['save/raw'])} | "
                     f"{num(r['load/raw'])} | {num(r['save/dcp'])} | {num(r['load/dcp'])} | "
                     f"{raw['rounds'][m][0]['verified']} |")
    lines.append("")
    lines.append("blocking split as save reports it (medians, ms): " + "; ".join(
        f"{m}: " + ", ".join(f"{n} {v * 1e3:.1f}" for n, v in med[m]["save_phases_s"].items())
        for m in (*OURS, "stream_pinned") if med.get(m, {}).get("save_phases_s")))
    judged = "not judged: " + summary["targets_not_judged"] if summary["targets_not_judged"] else "judged"
    lines.append(f"targets ({judged}): " + ", ".join(
        f"{k}: {'n/a' if ok is None else 'PASS' if ok else 'FAIL'}" for k, ok in summary["targets"].items()))
    if raw["dcp_errors"]:
        lines.append(f"DCP: {len(raw['dcp_errors'])} save(s) failed inside DCP ({raw['dcp_best_stagers_created']} best "
                     f"stagers created); first: {raw['dcp_errors'][0]}")
    return "\n".join(lines)
