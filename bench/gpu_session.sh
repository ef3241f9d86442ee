#!/usr/bin/env bash
# The GPU checks as one prepared run, for a GPU machine at hand for a few minutes.
#
#   bash bench/gpu_session.sh prepare   # here, with .venv: wheels, multi30k data and params
#   bash bench/gpu_session.sh           # there, from the repository root ($OUT: results)
#
# `prepare` fills two git-ignored folders that travel with the working tree: .whl/ (wheels of
# what a CUDA PyTorch image lacks) and .gpu/ (the multi30k preset's data, each part's params
# files). PARTS picks the parts (default "1 2 3"; a sub-part as "1c"), each under its own time
# limit, so that one failure leaves the others:
#   1a. bench.gpu_step: base and big, bf16, eager, new batch shapes every step
#   1c. bench.gpu_step: base on batch shapes met before, first and last step profiled
#   2.  bench.gpu_step: base, torch.compile inside DDP under torchrun (NCCL), graphs counted
#   3.  the multi30k preset: train (STEPS; MINUTES a guard), average, translate, score
#   4.  recipe screen: SCREEN's arms x SEEDS side by side for their steps, scored on valid
#   6.  towards convergence: CONV's arms x CONV_SEEDS, 8k-token steps, CONV_MINUTES each;
#       the best arm on valid then translates and scores test2016
#   7.  bench.gpu_step: fp16 (dynamic loss scaling) against bf16, 1 x 25,000 tokens, ABAB
#   8.  Table 3's rows built on the multi30k preset (aiayn.experiments.table3), TABLE3_MINUTES each
#   9.  bench.decode_batching on the GPU: greedy and beam 8 by batch size, against baselines
#   11. de->en: part 6's chosen arm (DEEN_ARM overrides) with source and target swapped
# Results: $OUT/session.log, gpu_step_*.json, m30k.tar.gz, screen/, and results.tar.gz
# (parts 6-11: JSON records, run folders' params.yaml, run.log, metrics/). Past runs and
# their timings: docs/results/gpu-h200/.
set -u
STEPS=${STEPS:-4000}
MINUTES=${MINUTES:-3}
PY=${PY:-python3}
M30K=${M30K:-../shared/data/multi30k}  # the corpus (prepare only): {train,val,test2016}.{en,de}
PARTS=${PARTS:-"1 2 3"}                 # which parts to run: "1 2 3", or sub-parts ("1c 3")
WORK=${WORK:-.gpu/m30k}                 # part 3's folder
# part 4: "name:KEY=VALUE KEY=VALUE;name:..." (no settings: the preset; an arm's train.steps
# overrides SCREEN_STEPS). The default: model shapes, each for the steps the AVX2-only CPU's
# hour holds at its speed (docs/results/bench/2026-11-cpu-step-history.md, --arm)
SCREEN=${SCREEN:-"preset:;ff512:model.d_ff=512 train.steps=2055;l2:model.encoder_layers=2 model.decoder_layers=2 train.steps=2240;d192:model.d_model=192 model.heads=3 model.d_ff=768 train.steps=2520;d320:model.d_model=320 model.heads=5 model.d_ff=1280 train.steps=1280"}
SEEDS=${SEEDS:-"1 2 3"}
SCREEN_STEPS=${SCREEN_STEPS:-1750}      # the AVX2-only CPU's hour of the preset
SCREEN_MINUTES=${SCREEN_MINUTES:-7}     # a guard only: the steps end each run first
PART7_SECONDS=${PART7_SECONDS:-330}     # part 7's deadline, all its runs together
# part 6: arms as SCREEN's, on the preset with 8k-token steps; an arm that sets the data
# stages (data.*, vocab.*, survey.*, shard.*) trains on data `prepare` builds for it
CONV=${CONV:-"rdrop:train.rdrop=5;d0.3:model.dropout=0.3;reg:model.dropout=0.3 train.attention_dropout=0.1 train.activation_dropout=0.1 train.subword_split=0.1;wide:model.d_model=512 model.heads=8 model.d_ff=2048 model.dropout=0.4;v10k:model.dropout=0.3 vocab.vocab_size=10260"}
CONV_AVERAGE=${CONV_AVERAGE:-"[1,5,10,20,30]"}
CONV_SEEDS=${CONV_SEEDS:-"1 2"}
CONV_STEPS=${CONV_STEPS:-8000}          # the published recipe's 8,000 updates of ~8k tokens
CONV_MINUTES=${CONV_MINUTES:-4}         # each run's time budget (validation included)
TABLE3_MINUTES=${TABLE3_MINUTES:-5}     # part 8: each of Table 3's rows, side by side
DECODE_MODEL=${DECODE_MODEL:-}          # part 9 (prepare): a model folder to carry
# part 9 (prepare): baseline decoders (055b2b1: before the grouped state; 0b24f1f: bf16 weights)
DECODE_BASELINES=${DECODE_BASELINES:-"055b2b1 0b24f1f"}
DECODE_BATCHES=${DECODE_BATCHES:-"64,128,1024"}
DECODE_DEVICE=${DECODE_DEVICE:-cuda}   # part 9 (cpu: a dry run here)

# own_data "KEY=VALUE ...": those of an arm's settings that the data stages read; an arm of
# part 6 with any of them trains on data of its own, built by `prepare` with them
own_data() {
    local - w && set -f  # words, not file patterns: x=[32] would match a file named x=3
    for w in $1; do case $w in data.*|vocab.*|survey.*|shard.*) echo "$w";; esac; done
}

if [ "${1:-}" = prepare ]; then
    set -e
    # (also the run folders and results of an earlier run or dry run: they would travel and
    # be packed with this run's; a DECODE_MODEL is ~30 MB of what travels)
    rm -rf .whl .gpu/m30k .gpu/out .gpu/deen && mkdir -p .gpu/m30k
    for d in .whl .gpu; do grep -qx "/$d/" .git/info/exclude || echo "/$d/" >> .git/info/exclude; done
    # Python 3.12 wheels for the CUDA image (versions as this project's .venv resolves them)
    .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl \
        $(.venv/bin/python -m pip list --format=freeze 2>/dev/null | grep -iE \
          '^(pydantic|pydantic[-_]core|annotated[-_]types|typing[-_]inspection|typing[-_]extensions|sacremoses)==')
    .venv/bin/aiayn params multi30k train.max_minutes="$MINUTES" train.steps="$STEPS" \
        data.source=local data.local.dir="$(realpath "$M30K")" --out .gpu/m30k/params.yaml
    (cd .gpu/m30k && for s in download vocab survey shard; do
        ../../.venv/bin/aiayn "$s" --params params.yaml; done)
    rm -rf .gpu/m30k/data/survey .gpu/m30k/metrics .gpu/screen && mkdir -p .gpu/screen
    IFS=';' read -ra arms <<< "$SCREEN"
    for arm in "${arms[@]}"; do
        for seed in $SEEDS; do  # shell word splitting of the arm's settings is meant
            # shellcheck disable=SC2086
            .venv/bin/aiayn params multi30k train.steps="$SCREEN_STEPS" \
                train.max_minutes="$SCREEN_MINUTES" \
                train.valid_bleu_every=0 seed="$seed" ${arm#*:} \
                --out ".gpu/screen/${arm%%:*}-s$seed.yaml" >/dev/null
        done
    done
    ls .gpu/screen
    # part 6: the preset's data cut into 8,192-token batches, and one params file per run;
    # part 11: the same for de->en (the shared BPE: the same tokenizer, other shards)
    m30k8k() {  # $1: the folder; the rest: settings on top of the preset (KEY=VALUE)
        local dir=$1 s; shift
        rm -rf "$dir" && mkdir -p "$dir"
        .venv/bin/aiayn params multi30k shard.max_tokens=8192 data.source=local \
            data.local.dir="$(realpath "$M30K")" \
            "$@" --out "$dir/params.yaml" >/dev/null
        (cd "$dir" && for s in download vocab survey shard; do
            ../../.venv/bin/aiayn "$s" --params params.yaml; done)
        rm -rf "$dir/data/survey" "$dir/metrics"
    }
    rm -rf .gpu/m30k8k* .gpu/conv && mkdir -p .gpu/conv
    m30k8k .gpu/m30k8k
    m30k8k .gpu/m30k8k-deen data.src_lang=de data.tgt_lang=en
    IFS=';' read -ra arms <<< "$CONV"
    for arm in "${arms[@]}"; do
        # an arm that sets the data stages gets its own data, both directions; its runs'
        # .data files name it (side_by_side links it in instead of the part's)
        mapfile -t own < <(own_data "${arm#*:}")
        if [ ${#own[@]} -gt 0 ]; then
            m30k8k ".gpu/m30k8k-${arm%%:*}" "${own[@]}"
            m30k8k ".gpu/m30k8k-${arm%%:*}-deen" "${own[@]}" data.src_lang=de data.tgt_lang=en
        fi
        for seed in $CONV_SEEDS; do  # shell word splitting of the arm's settings is meant
            # shellcheck disable=SC2086
            .venv/bin/aiayn params multi30k shard.max_tokens=8192 train.tokens_per_step=8192 \
                train.steps="$CONV_STEPS" train.max_minutes="$CONV_MINUTES" \
                train.valid_bleu_every=1000 train.checkpoint_every_steps=200 seed="$seed" \
                "train.average_candidates=$CONV_AVERAGE" \
                ${arm#*:} --out ".gpu/conv/${arm%%:*}-s$seed.yaml" >/dev/null
            [ ${#own[@]} -eq 0 ] || echo ".gpu/m30k8k-${arm%%:*}/data" > ".gpu/conv/${arm%%:*}-s$seed.data"
        done
    done
    ls .gpu/conv
    # part 8: Table 3's rows built on the multi30k preset (aiayn.experiments.table3: the paper's changes
    # to its base, made to this base), each for TABLE3_MINUTES, no averaging (the paper's
    # Table 3: beam search, no checkpoint averaging), validation BLEU only at the end
    rm -rf .gpu/table3 && mkdir -p .gpu/table3
    TABLE3_MINUTES=$TABLE3_MINUTES .venv/bin/python - <<'PYEOF'
import os
from pathlib import Path

import yaml

from aiayn.experiments import table3 as t3

raw = yaml.safe_load(Path(".gpu/m30k/params.yaml").read_text())
common = {**t3.budget(minutes=float(os.environ["TABLE3_MINUTES"])), "train.steps": 100000,
          "train.average_candidates": [], "train.average_last": 1,
          "train.valid_bleu_every": 0, "train.checkpoint_every_steps": 500}
for row in t3.build_rows(raw, t3.select_rows(None), common):
    if row.error:
        print(f"{row.row.name}: left out ({row.error})")
        continue
    out = Path(".gpu/table3") / f"{row.row.name}.yaml"
    out.write_text(yaml.safe_dump(t3.merge(raw, t3.nested(row.overrides)), sort_keys=False))
PYEOF
    ls .gpu/table3 | wc -l
    # part 9: the valid split's text, the baseline's decoder, and a model to decode with
    rm -rf .gpu/decode && mkdir -p .gpu/decode/baselines
    cp "$M30K"/val.en "$M30K"/val.de .gpu/decode/
    for b in $DECODE_BASELINES; do
        mkdir -p ".gpu/decode/baselines/$b" && git archive "$b" aiayn | tar -x -C ".gpu/decode/baselines/$b"
    done
    if [ -n "$DECODE_MODEL" ]; then
        cp -r "$DECODE_MODEL" .gpu/decode/model
    fi
    du -sh .whl .gpu
    exit 0
fi

OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
exec > >(tee "$OUT/session.log") 2>&1
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
part() { echo; echo "=== $1 ($(date -u +%T))"; }
# want 1c: true when PARTS names 1c, or part 1 whole (a sub-part is a digit and a letter:
# part 11 is not a sub-part of part 1)
want() {
    case " $PARTS " in *" $1 "*) return 0;; esac
    case $1 in [0-9][a-z]) case " $PARTS " in *" ${1:0:1} "*) return 0;; esac;; esac
    return 1
}

part "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
torch.cuda.get_device_name(), 'bf16', torch.cuda.is_bf16_supported())"
nproc
# Every part measures a GPU: without one, stop here rather than write CPU records under the
# GPU parts' names. GPU_SESSION_ALLOW_CPU=1 runs the parts anyway (a check of this script).
if [ -z "${GPU_SESSION_ALLOW_CPU:-}" ] \
        && ! $PY -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
    echo "NO GPU: torch sees no CUDA device here (a CPU build, no driver, or" \
         "CUDA_VISIBLE_DEVICES empty); stopping before any part." >&2
    exit 1
fi

if want 1a; then
part "1a. gpu_step: base and big, bf16, eager, new batch shapes every step"
timeout 150 $PY -m bench.gpu_step --configs base,big --json "$OUT/gpu_step_eager.json" \
    || echo "PART 1a FAILED ($?)"
fi
if want 1c; then
part "1c. base on shapes met before (--reuse), first and last step profiled"
timeout 120 $PY -m bench.gpu_step --configs base --warmup 30 --steps 10 --reuse --profile \
    --json "$OUT/gpu_step_reuse.json" | grep -v "^USDT"
rc=${PIPESTATUS[0]}  # the benchmark's status, not grep's
[ "$rc" -eq 0 ] || echo "PART 1c FAILED ($rc)"
fi
if want 2; then
part "2. gpu_step: base, torch.compile inside DDP (torchrun, NCCL)"
timeout 240 $PY -m torch.distributed.run --standalone --nproc-per-node 1 -m bench.gpu_step --ddp --compile \
    --configs base --warmup 8 --json "$OUT/gpu_step_compile_ddp.json" || echo "PART 2 FAILED ($?)"
fi

if want 3; then
part "3. multi30k preset on the GPU: train, average, translate, score"
m30k() {  # each step only after the one before it succeeded
    cd "$WORK" && rm -rf data/checkpoints data/model data/translations metrics \
    && timeout $((MINUTES * 60 + 120)) $PY -m stages.train --no-progress --no-mlflow \
    && $PY -m stages.average --no-mlflow \
    && $PY -m stages.translate --split valid --no-progress \
    && $PY -m stages.translate --split test --no-progress \
    && $PY -m stages.score --split valid --metrics metrics/bleu_valid.json --no-mlflow \
    && $PY -m stages.score --no-mlflow
}
(m30k) || echo "PART 3 FAILED ($?)"
(cd "$WORK" && tar czf "$OUT/m30k.tar.gz" params.yaml metrics data/translations \
    data/model/config.json 2>/dev/null)
[ -f "$WORK/metrics/bleu.json" ] && cat "$WORK/metrics/train.json" "$WORK/metrics/bleu.json"
fi
# Parts 4, 6 and 8: folders of params files, each trained side by side on the one GPU, then
# averaged, translated and scored on valid by the pipeline's own stages.
valid_run() (  # $1: the run's folder (params.yaml); $2: the data folder linked in; $3: its
               # time budget in minutes (a guard: timeout); $4: threads a run may use
    cd "$1" && mkdir -p data && for x in raw vocab shards; do ln -sfn "$2/$x" data/$x; done \
    && OMP_NUM_THREADS=$4 timeout $(($3 * 60 + 120)) $PY -m stages.train --no-progress --no-mlflow \
    && OMP_NUM_THREADS=$4 $PY -m stages.average --no-mlflow \
    && OMP_NUM_THREADS=$4 $PY -m stages.translate --split valid --no-progress \
    && $PY -m stages.score --split valid --metrics metrics/bleu_valid.json --no-mlflow
)
keep_run() {  # copy run folder $1's params, log and metrics into $2/<run>/
    mkdir -p "$2/${1##*/}" && cp -r "$1/params.yaml" "$1/run.log" "$1/metrics" \
        "$2/${1##*/}/" 2>/dev/null
}
test_run() {  # $1: the part; $2: a run folder that valid_run trained; $3: where it is kept.
    # Translates and scores test2016, keeps the run's records, prints its test scores.
    ( cd "$2" && OMP_NUM_THREADS=4 $PY -m stages.translate --split test --no-progress >> run.log 2>&1 \
      && $PY -m stages.score --no-mlflow >> run.log 2>&1 ) || echo "PART $1 TEST FAILED: $2"
    keep_run "$2" "$3"
    $PY -c "import json, sys; b = json.load(open(sys.argv[1])); print(sys.argv[1], 'test2016 \
sacreBLEU', b['sacrebleu']['score'], 'chrF', b.get('chrf', {}).get('score'), 'lowercased \
tokenized', b['lowercase_bleu']['score'])" "$2/metrics/bleu.json" || true
}
side_by_side() {  # $1: the part; $2: the folder of <run>.yaml files; $3: the data folder
                  # (a run's own where <run>.data names one); $4: minutes; $5: threads a
                  # run; $6: where each run's records are kept
    local pids=() f d data  # waited for by pid: a bare `wait` would also wait for the log's tee
    for f in "$2"/*.yaml; do
        d=$2/$(basename "$f" .yaml) && mkdir -p "$d" && cp "$f" "$d/params.yaml"
        data=$3 && [ -f "${f%.yaml}.data" ] && data=$PWD/$(cat "${f%.yaml}.data")
        (valid_run "$d" "$data" "$4" "$5" > "$d/run.log" 2>&1 || echo "PART $1 FAILED: $d ($?)"
         keep_run "$d" "$6") &  # each run's results as soon as it ends
        pids+=($!)
    done
    wait "${pids[@]}"
}

if want 4; then
part "4. recipe screen: $(ls .gpu/screen/*.yaml | wc -l) runs side by side"
side_by_side 4 .gpu/screen "$PWD/$WORK/data" "$SCREEN_MINUTES" 2 "$OUT/screen"
$PY -m bench.screen_table --runs .gpu/screen/*/
fi
RES=$PWD/.gpu/out  # parts 6-11 write here; packed into $OUT/results.tar.gz after each
mkdir -p "$RES"
pack() { tar czf "$OUT/results.tar.gz" -C "$RES" . 2>/dev/null; }

step_run() {  # $1: the JSON's name, $2: the seconds it may take at most; the rest: arguments
    # (the part's $deadline and $label set by the part)
    local name=$1 limit=$2 left=$((deadline - SECONDS)); shift 2
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 15 ]; then echo "PART $label SKIPPED $name: the part's deadline"; return; fi
    timeout "$limit" $PY -m bench.gpu_step --configs base,big --count-kernels "$@" \
        --json "$RES/gpu_step_$name.json" || echo "PART $label FAILED $name ($?)"
}

if want 7; then
part "7. fp16 (dynamic loss scaling) against bf16, 1 x 25000, eager, ABAB; big compiled"
deadline=$((SECONDS + PART7_SECONDS)) label=7
for round in 1 2; do
    step_run "bf16_$round" 50 --warmup 3 --steps 8 --max-tokens 25000 --precision bf16
    step_run "fp16_$round" 50 --warmup 3 --steps 8 --max-tokens 25000 --precision fp16
done
step_run big_compile 200 --configs big --warmup 6 --steps 8 --max-tokens 25000 --compile
pack
fi

if want 8; then
part "8. Table 3 on multi30k: $(ls .gpu/table3/*.yaml | wc -l) rows side by side, $TABLE3_MINUTES min each"
side_by_side 8 .gpu/table3 "$PWD/$WORK/data" "$TABLE3_MINUTES" 1 "$RES/table3"
$PY -m stages.results --table3 --metrics "$RES" --runs .gpu/table3/*/
pack
fi

if want 6; then
part "6. multi30k towards convergence: $(ls .gpu/conv/*.yaml | wc -l) runs side by side"
side_by_side 6 .gpu/conv "$PWD/.gpu/m30k8k/data" "$CONV_MINUTES" 3 "$RES/conv"
pack
$PY -m bench.screen_table --runs .gpu/conv/*/ | tee "$RES/conv_summary.log"
# the recipe is chosen on valid: the arm with the best mean valid sacreBLEU translates test
best=$($PY - <<'PYEOF'
import json, pathlib, statistics
arms = {}
for f in pathlib.Path(".gpu/conv").glob("*/metrics/bleu_valid.json"):
    arm = f.parent.parent.name.rsplit("-s", 1)[0]
    arms.setdefault(arm, []).append(json.loads(f.read_text())["sacrebleu"]["score"])
print(max(arms, key=lambda a: statistics.fmean(arms[a])) if arms else "")
PYEOF
)
echo "chosen on valid: ${best:-none}"
echo "$best" > "$RES/conv_best.txt"
for d in .gpu/conv/"$best"-s*/; do
    [ -n "$best" ] || break
    test_run 6 "${d%/}" "$RES/conv"
done
pack
fi

if want 11; then
arm=${DEEN_ARM:-$(cat "$RES/conv_best.txt" 2>/dev/null)}
arm=${arm:-d0.3}
part "11. de->en: arm $arm, seeds $CONV_SEEDS side by side, then test2016"
rm -rf .gpu/deen && mkdir -p .gpu/deen
for seed in $CONV_SEEDS; do
    sed -e 's/^  src_lang: en$/  src_lang: de/' -e 's/^  tgt_lang: de$/  tgt_lang: en/' \
        ".gpu/conv/$arm-s$seed.yaml" > ".gpu/deen/$arm-s$seed.yaml"
    # an arm with its own data (.gpu/m30k8k-<arm>/data): its de->en folder beside it
    own=$(cat ".gpu/conv/$arm-s$seed.data" 2>/dev/null) \
        && echo "${own%/data}-deen/data" > ".gpu/deen/$arm-s$seed.data"
done
side_by_side 11 .gpu/deen "$PWD/.gpu/m30k8k-deen/data" "$CONV_MINUTES" 3 "$RES/deen"
for d in .gpu/deen/*/; do
    test_run 11 "${d%/}" "$RES/deen"
done
pack
fi
if want 9; then
part "9. decoding on the GPU: greedy and beam 8 over the valid sources, by batch size"
# the model: prepare's copy of DECODE_MODEL, else one an earlier part trained, else 2 minutes
# of the preset trained here (train and average only)
model=""
for m in .gpu/decode/model "$WORK"/data/model .gpu/table3/table3-base/data/model \
         .gpu/conv/*/data/model; do
    [ -f "$m/model.safetensors" ] && { model=$m; break; }
done
if [ -z "$model" ]; then
    d=.gpu/decode/train && wd=$(realpath "$WORK") && mkdir -p "$d" \
    && sed 's/^  max_minutes: .*/  max_minutes: 2/' "$wd/params.yaml" > "$d/params.yaml" \
    && (cd "$d" && mkdir -p data && for x in raw vocab shards; do
            ln -sfn "$wd/data/$x" data/$x; done \
        && timeout 300 $PY -m stages.train --no-progress --no-mlflow > run.log 2>&1 \
        && $PY -m stages.average --no-mlflow >> run.log 2>&1) \
    && model=$d/data/model || echo "PART 9: training its model FAILED (see $d/run.log)"
fi
if [ -n "$model" ]; then
    echo "model: $model"
    timeout 300 $PY -m bench.decode_batching --device "$DECODE_DEVICE" --model "$model" \
        --inputs .gpu/decode/val.en --references .gpu/decode/val.de \
        $(for b in .gpu/decode/baselines/*/; do echo --baseline "$b"; done) \
        --batch-sizes "$DECODE_BATCHES" --beams 1,8 \
        --alpha 1.4 --rounds 2 --json "$RES/decode_batching.json" \
        || echo "PART 9 FAILED or timed out"
fi
pack
fi
part "done"
