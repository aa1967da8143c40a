#!/usr/bin/env bash
# The main job on the embedded default target, SmolLM2-135M-Instruct, end to end on CPU:
# regenerate answers -> render + fp8 feature cache -> train DSpark and DFlash with the same
# budget -> evaluate both on the nine benchmarks (T=1.0 and greedy) -> Table-1-style report.
#   bash scripts/demo.sh          35-60 minutes on 2 CPU cores
#   bash scripts/demo.sh --long   four times the training budget and more evaluation prompts
source "$(dirname "$0")/setup_env.sh"

LONG=0
for arg in "$@"; do
  case "$arg" in
    --long) LONG=1 ;;
    *) echo "usage: bash scripts/demo.sh [--long]" >&2; exit 2 ;;
  esac
done

OUT="${DSPARK_DEMO_OUT:-runs/demo}"
DATA="$OUT/data"
EVAL_DATA="${DSPARK_EVAL_DATA:-}"
if [ -z "$EVAL_DATA" ]; then
  for d in ../shared/eval_datasets eval_datasets; do
    if ls "$d"/*.jsonl >/dev/null 2>&1; then EVAL_DATA="$d"; break; fi
  done
fi
# Training budget as epochs over the ~200 regenerated answers (the LR schedule is set by it);
# the wall-clock cap only guards a much slower machine.
if [ "$LONG" = 1 ]; then
  EPOCHS=5; CAP_MIN=40; SAMPLES=8; MAXNEW=192; OUT="$OUT-long"
else
  EPOCHS=1.25; CAP_MIN=10; SAMPLES=1; MAXNEW=64
fi
DS=config/dspark/dspark_smollm2_135m.py
DF=config/dflash/dflash_smollm2_135m.py
SET_DATA="data.data_dir=$DATA"

echo "== 1/4 data: SmolLM2 answers the built-in prompts, rendered, features cached (fp8)"
dspark prepare --config "$DS" --set "$SET_DATA"

echo "== 2/4 training DSpark and DFlash with the same budget ($EPOCHS epochs each)"
for cfg in "$DS" "$DF"; do
  name=$(basename "$cfg" .py)
  dspark train --config "$cfg" --resume --set "$SET_DATA" "out_dir=$OUT/$name" \
    "train.epochs=$EPOCHS" "train.max_wall_minutes=$CAP_MIN"
done

echo "== 3/4 evaluation on the nine benchmarks ($SAMPLES prompts each, $MAXNEW new tokens)"
EVAL_ARGS=(--target smollm2-135m --num-samples "$SAMPLES" --max-new-tokens "$MAXNEW")
if [ -n "$EVAL_DATA" ]; then
  EVAL_ARGS+=(--data-dir "$EVAL_DATA")
else
  echo "   (no benchmark files found: using the built-in evaluation prompts instead)"
  EVAL_ARGS+=(--builtin-eval)
fi
for temp in 1.0 0.0; do
  for name in dspark_smollm2_135m dflash_smollm2_135m; do
    dspark eval "${EVAL_ARGS[@]}" --draft "$OUT/$name/drafter" --temperature "$temp" \
      --label "${name%%_*}" --out "$OUT/eval-T$temp/$name"
  done
done

echo "== 4/4 report"
for temp in 1.0 0.0; do
  echo; echo "### accepted length τ, temperature $temp (γ = 7; speedup = wall clock vs target-only on this CPU)"
  dspark compare "$OUT/eval-T$temp/dspark_smollm2_135m" "$OUT/eval-T$temp/dflash_smollm2_135m" \
    --out "$OUT/report-T$temp.md"
done
echo; echo "reports, per-round logs and plots: $OUT/eval-T*/*/ (report.md, report.json, rounds.jsonl, *.png)"
