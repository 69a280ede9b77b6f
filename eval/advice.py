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
    `tars`: {drafter: accepted / proposed}; `commands`: {drafter: {K: vLLM command}}."""
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
    warnings = [
        f"{name}: TAR {tar:.0%} < {LOW_TAR:.0%}: most draft tokens are rejected; a lower K or a better "
        f"head would waste less verification"
        for name, tar in (tars or {}).items()
        if tar is not None and tar < LOW_TAR
    ]
    return {
        "serve": serve,
        "best_k": best_k,
        "speculation_off_from_concurrency": off_from,
        "command_at_lowest_concurrency": command,
        "warnings": warnings,
    }


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
