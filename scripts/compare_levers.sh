#!/usr/bin/env bash
# Decide issue 53's levers: each trains the quickstart recipe on the same pinned data beside
# the baseline (no time budget: every run reads the same conversations and trains the same
# epochs) and is evaluated on all 80 MT-bench prompts, both turns, with --json. Later, one
# at a time; the CPU to itself (hours: ~25 min of training per EAGLE-3 lever here).
#
#   bash scripts/compare_levers.sh                  # every lever
#   LEVERS="baseline lk adamw" bash scripts/compare_levers.sh
#
# Levers (EAGLE-3, recipes/smollm2-135m-eagle3.yaml):
#   baseline   the recipe as it is
#   normout    head.norm_output=true (EAGLE 3.1 feedback between TTT steps and drafts)
#   tv, lk     train.loss=tv / lk (acceptance-targeted losses; also evaluated at T = 1)
#   adamw      train.optimizer=adamw (AdamW for every weight; the recipe trains its hidden
#              matrices with Muon)
# P-EAGLE (recipes/smollm2-135m-peagle.yaml, started from this script's baseline head):
#   pe1        1 layer, COD drawn at every position (the recipe)
#   pe1-lab    1 layer, COD drawn only on labelled chains
#   pe2, pe4   2 / 4 layers (the added ones start as the identity)
# Environment (pinned so the runs compare; the defaults are the real measurement):
#   LEVERS_DIR (runs/levers), LEVERS_SAMPLES (data.max_samples, 5400), LEVERS_EPOCHS
#   (EAGLE-3 train.epochs, 4), LEVERS_PE_EPOCHS (P-EAGLE, 5), LEVERS_PROMPTS
#   (eval.max_prompts, 80), LEVERS_STEPS (train.max_steps; unset: the epochs decide; a
#   smoke sets it), LEVERS_TOKENS (eval.max_new_tokens, 96).
# The report: $LEVERS_DIR/eval-T0.json, every lever's head in one eval beside the first
# lever's (their differences paired by sequence), and eval-T1.json for the baseline, tv
# and lk; the summary table at the end reads them (also on its own: `bash
# scripts/compare_levers.sh summary`). Reruns resume / skip what is done.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${LEVERS_DIR:-runs/levers}
SAMPLES=${LEVERS_SAMPLES:-5400}
EPOCHS=${LEVERS_EPOCHS:-4}
PE_EPOCHS=${LEVERS_PE_EPOCHS:-5}
PROMPTS=${LEVERS_PROMPTS:-80}
TOKENS=${LEVERS_TOKENS:-96}
LEVERS=${LEVERS:-baseline normout tv lk adamw pe1 pe1-lab pe2 pe4}
EYAS=(.venv/bin/eyas)
E3=recipes/smollm2-135m-eagle3.yaml
PE=recipes/smollm2-135m-peagle.yaml
export TOKENIZERS_PARALLELISM=false
# the data every lever reads, and the target's dtype pinned (auto may pick another on a
# faster or slower phase of the machine)
DATA=("target.dtype=bfloat16" "data.max_samples=$SAMPLES")
STEPS=()
[ -z "${LEVERS_STEPS:-}" ] || STEPS=("train.max_steps=$LEVERS_STEPS")

lever_args() {  # recipe file, then the overrides of lever $1
  case $1 in
    baseline) echo "$E3" ;;
    normout) echo "$E3 head.norm_output=true" ;;
    tv) echo "$E3 train.loss=tv" ;;
    lk) echo "$E3 train.loss=lk" ;;
    adamw) echo "$E3 train.optimizer=adamw" ;;
    pe1) echo "$PE" ;;
    pe1-lab) echo "$PE train.peagle.cod_labelled_only=true" ;;
    pe2) echo "$PE head.num_layers=2" ;;
    pe4) echo "$PE head.num_layers=4" ;;
    *) echo "unknown lever $1" >&2; return 1 ;;
  esac
}

summary() {
  .venv/bin/python - "$DIR" <<'EOF'
import json, sys
from pathlib import Path
root = Path(sys.argv[1])
print(f"{'lever':10} {'T':>3} {'tau':>6} {'±':>5} {'vs first':>15} {'TAR':>6}  per-position acceptance   lossless")
for temp in ("T0", "T1"):
    path = root / f"eval-{temp}.json"
    if not path.is_file():
        continue
    report = json.loads(path.read_text())
    names = {"head": report["lever_names"][0]}  # the compared heads carry their lever's name
    fmt = lambda v: "-" if v is None else f"{v:.3f}"
    for name, d in report["drafters"].items():
        acc = " ".join("-" if a is None else f"{a:.2f}" for a in d.get("per_position_acceptance") or [])
        paired = report["paired_vs_head"].get(name)
        vs = f"{paired['difference']:+.3f}±{paired['se']:.3f}" if paired else ""
        print(f"{names.get(name, name):10} {temp[1]:>3} {fmt(d.get('tau')):>6} {fmt(d.get('tau_se')):>5} "
              f"{vs:>15} {fmt(d.get('tar')):>6}  {acc:24} {report['lossless'].get('passed')}")
EOF
}

main() {
if [ "${1:-}" = summary ]; then summary; return; fi

echo "=== data: prepare + capture once ($DIR/data, data.max_samples=$SAMPLES)"
"${EYAS[@]}" prepare -r "$E3" "run_dir=$DIR/data" "${DATA[@]}"
"${EYAS[@]}" capture -r "$E3" "run_dir=$DIR/data" "${DATA[@]}"

for lever in $LEVERS; do
  read -r -a spec <<< "$(lever_args "$lever")"
  recipe=${spec[0]}
  over=("${spec[@]:1}" "run_dir=$DIR/$lever" "data.from_run=$DIR/data" "${DATA[@]}" "${STEPS[@]}")
  if [ "$recipe" = "$PE" ]; then
    over+=("train.init_from=$DIR/baseline/export" "train.epochs=$PE_EPOCHS")
  else
    over+=("train.epochs=$EPOCHS")
  fi
  echo "=== $lever: ${spec[*]:1}"
  "${EYAS[@]}" train -r "$recipe" --no-progress "${over[@]}"
  "${EYAS[@]}" export -r "$recipe" "${over[@]}"
done

# One eval per temperature, every lever's head decoded on the same prompts beside the
# first one's, so each difference is paired sequence by sequence (paired_vs_head). A
# killed eval run again resumes from its eval_sequences.jsonl.
for t in 0 1; do
  heads=()
  for lever in $LEVERS; do
    case $t:$lever in 0:*|1:baseline|1:tv|1:lk) heads+=("$lever") ;; esac
  done
  [ ${#heads[@]} -gt 0 ] || continue
  json=$DIR/eval-T$t.json
  [ -s "$json" ] && continue  # evaluated by an earlier run of this script
  args=(--head "$DIR/${heads[0]}/export")
  for lever in "${heads[@]:1}"; do args+=(--compare "$lever=$DIR/$lever/export"); done
  "${EYAS[@]}" eval -r "$E3" --json --no-progress --temperature "$t" --max-prompts "$PROMPTS" \
    --max-new-tokens "$TOKENS" --out "$DIR/eval-T$t" "${args[@]}" "run_dir=$DIR/data" "${DATA[@]}" > "$json.part"
  # the lever names in the order decoded (the head first), for the summary
  .venv/bin/python -c 'import json, sys; p = sys.argv[1]; r = json.load(open(p)); r["lever_names"] = sys.argv[2:]; json.dump(r, open(p, "w"), indent=2)' \
    "$json.part" "${heads[@]}"
  mv "$json.part" "$json"
done
summary
}

# in a function, called on the last line: bash reads a script as it runs, so an edit to
# this file during a run (hours) would otherwise change what the running one executes
main "$@"
