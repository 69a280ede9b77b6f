"""A serving recommendation a proxy can act on, from a speedup table measured by
`eyas bench-serve` or predicted by `eyas plan` (DESIGN §6.3): per concurrency the drafter
and K to serve, the concurrency from which speculation should be off, the vLLM command,
and a warning for drafters whose draft tokens are mostly rejected.
"""

from __future__ import annotations

# Below this share of accepted draft tokens most of the head's work is thrown away: the
# engine verifies K tokens to keep a fraction of one.
LOW_TAR = 0.30


def advise(table: dict, tars: dict | None = None, commands: dict | None = None) -> dict:
    """`table`: {drafter: {K: {concurrency: speedup}}} (keys may be str or int).
    `tars`: {drafter: {K: accepted / proposed}}, or {drafter: TAR} at the K served at the
    lowest concurrency; `commands`: {drafter: {K: vLLM command}}."""
    per_conc: dict[int, dict] = {}
    best_k: dict[str, dict[str, int]] = {}
    for name, by_k in table.items():
        mine: dict[int, tuple] = {}
        for k, by_c in by_k.items():
            for c, s in by_c.items():
                c = int(c)
                if c not in mine or s > mine[c][1]:
                    mine[c] = (int(k), s)
                if c not in per_conc or s > per_conc[c]["speedup"]:
                    per_conc[c] = {"drafter": name, "k": int(k), "speedup": s}
        best_k[name] = {str(c): mine[c][0] for c in sorted(mine)}
    concs = sorted(per_conc)
    off_from = next((c for c in concs if per_conc[c]["speedup"] <= 1.0), None)
    serve = {
        str(c): (
            per_conc[c] if per_conc[c]["speedup"] > 1.0 else {"drafter": None, "k": None, "speedup": 1.0}
        )
        for c in concs
    }
    first = per_conc[concs[0]] if concs else None
    command = None
    if first and first["speedup"] > 1.0 and commands:
        command = (commands.get(first["drafter"]) or {}).get(str(first["k"]))
    warnings = []
    for name, by_k in (tars or {}).items():
        served = best_k.get(name, {}).get(str(concs[0])) if concs else None
        if not isinstance(by_k, dict):  # a TAR at the K served (`eyas plan`)
            by_k = {str(served): by_k} if served is not None else {}
        warnings += [
            tar_alarm(name, int(k), tar, served, by_k.get(str(served)), concs[0] if concs else None)
            for k, tar in sorted(by_k.items(), key=lambda kv: int(kv[0]))
            if tar is not None and tar < LOW_TAR
        ]
    return {
        "serve": serve,
        "best_k": best_k,
        "speculation_off_from_concurrency": off_from,
        "command_at_lowest_concurrency": command,
        "warnings": warnings,
    }


def tar_alarm(name: str, k: int, tar: float, served: int | None, served_tar: float | None, conc) -> str:
    """The low-TAR warning, naming the K it judged: TAR falls as K grows (a head at 1.8
    tokens per forward shows 27% at K = 3 and 16% at K = 5), so it also names the K with
    the best speedup for this drafter at the lowest concurrency, the one to serve it at."""
    line = (
        f"{name}: TAR {tar:.0%} at K={k} < {LOW_TAR:.0%}: most of its {k} draft tokens per step are rejected"
    )
    if served is None:
        return line
    if served == k:
        return line + (
            f"; K={k} is also its fastest K at concurrency {conc}: a better head wastes less verification"
        )
    there = f", TAR {served_tar:.0%}" if served_tar is not None else ""
    return line + f"; serve {name} at K={served} instead (its fastest at concurrency {conc}{there})"


def format_advice(advice: dict) -> str:
    lines = ["recommendation:"]
    for c, pick in advice["serve"].items():
        lines.append(
            f"  concurrency {c}: "
            + (
                f"{pick['drafter']} K={pick['k']} ({pick['speedup']:.2f}x)"
                if pick["drafter"]
                else "plain (no drafter pays)"
            )
        )
    off = advice["speculation_off_from_concurrency"]
    if advice["serve"] and not any(pick["drafter"] for pick in advice["serve"].values()):
        lines.append("  do not speculate: no drafter beats plain decoding at any K and concurrency")
    else:
        lines.append(
            f"  switch speculation off from concurrency {off}"
            if off is not None
            else "  speculation pays at every concurrency measured"
        )
    if advice.get("command_at_lowest_concurrency"):
        lines.append(f"  serve: {advice['command_at_lowest_concurrency']}")
    lines += [f"  warning: {w}" for w in advice["warnings"]]
    return "\n".join(lines)
