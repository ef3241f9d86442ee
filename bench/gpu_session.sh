#!/usr/bin/env bash
# The GPU checks as one prepared run, for a GPU machine lent for a few minutes.
#
#   bash bench/gpu_session.sh prepare   # here, with .venv: wheels, multi30k data and params
#   bash bench/gpu_session.sh           # there, from the repository root ($OUT: results)
# The bench scripts run as modules from the repository root ($PY -m bench.gpu_step).
#
# `prepare` fills two git-ignored folders that travel with the working tree:
#   .whl/       wheels of what the pipeline needs beyond a CUDA PyTorch image (pydantic and
#               sacremoses; MLflow and DVC are not needed: stages run without --mlflow)
#   .gpu/m30k/  the multi30k preset's params.yaml (a step budget: STEPS, with a MINUTES
#               guard) and data/{raw,vocab,shards}, built by the pipeline's own stages.
# The run then, each part under its own time limit so that one failure leaves the others:
#   1. bench.gpu_step, base and big, bf16, eager: tokens/s, split, MFU; base again with
#      cuDNN attention allowed (the baseline of avoid_cudnn_attention), and on batch shapes
#      met before, profiled, and on them with the loss in the CPU's blocks (the baseline
#      of aiayn.kernels.loss_blocks on CUDA)
#   2. base with torch.compile inside DDP under torchrun (NCCL), graphs counted
#   3. the multi30k preset trained on the GPU by the train stage (bf16, fused Adam, pinned
#      prefetch, validation BLEU), then average, translate (valid, test) and score.
#   1e. base on shapes met before, bf16 weights cast once per step (the trainer's
#      aiayn.precision.step_casts) against once per micro-batch (--cast-per-batch), ABAB
#   4. a recipe screen (arms and seeds fixed by `prepare`'s SCREEN and SEEDS): the
#      multi30k preset with each arm's settings and each seed, trained side by side on the
#      one GPU (precision auto: bf16 there) for the steps that 2 AVX2-only CPU cores reach
#      in the preset's hour at the arm's speed (SCREEN_STEPS, or the arm's own
#      train.steps; the lr cooldown by steps, SCREEN_MINUTES only a guard), then average
#      (the count chosen on valid), translate valid, score valid.
#      Valid only: the recipe is chosen on valid.
#   5. micro-batch size (issue 44): bench.gpu_step, base and big, bf16, new shapes
#      every step, 25k target tokens per step as 4 x 6,250 (the default) or 1 x 25,000,
#      eager, ABAB, with the kernel launches of a step counted; then 1 x 25,000 compiled.
#      All under one deadline (PART5_SECONDS) so that part 6 keeps its time.
#   7. fp16 (issue 44, goal 3): gpu_step base and big, 1 x 25,000, bf16 against fp16 with
#      dynamic loss scaling, ABAB; then big compiled (did not fit part 5's deadline).
#   8. Table 3 (issue 46) on multi30k: the paper's 20 rows built on the preset by
#      aiayn.experiments.table3, side by side for TABLE3_MINUTES each (the cooldown by the clock), no
#      averaging, then translate and score valid; $RES/table3.md in the paper's layout.
#  10. repeated batch shapes (issue 44): on new shapes every matrix product pays ~120-250 us
#      of host time (cuBLAS's choice for a shape it has not met; ~12-27 us on shapes met
#      before: the 2026-11-26 profiles), and a packed decoder's row count is new at
#      every batch. gpu_step with widths padded to multiples of 8, the decoder on the padded
#      batch (--no-packing) and every shape met once before measuring (--warm-shapes: a
#      long run's steady state) against today's step, ABAB; the same without padding (the
#      shape cache's gain alone); then base compiled, default and reduce-overhead (CUDA
#      graphs, one per shape). Beside today's step in the same rounds, its baseline with
#      the int16 dropout masks on the GPU (--int16-dropout: five launches per dropout where
#      the model now keeps F.dropout's one). All under PART10_SECONDS.
#  11. de->en (issue 45): the arm part 6 chose on valid (DEEN_ARM overrides), its seeds with
#      source and target swapped, side by side as part 6 (CONV_MINUTES), then test2016.
#      A call of its own after part 6 on the same machine (~6 min), or alone with DEEN_ARM.
#   9. decoding on the GPU (issue 44, goal 2): bench.decode_batching over the multi30k
#      valid sources, greedy (the validation BLEU pass) and beam 8 at alpha 1.4 (the
#      preset's translate), with DECODE_BASELINES' decoders at decode.batch_size 64 against
#      this checkout's at DECODE_BATCHES, side by side; the model is `prepare`'s copy of
#      DECODE_MODEL (a folder written by `aiayn average`), else one that part 3, 8 or 6
#      trained, else the preset trained here for 2 minutes. Runs after the other parts.
#   6. multi30k towards convergence (issue 45): runs of CONV arms x CONV_SEEDS side by side
#      on the one GPU, each with 8,192-token batches (one micro-batch a step; shards of
#      `prepare`'s .gpu/m30k8k), up to CONV_STEPS steps, the time budget CONV_MINUTES (the
#      cooldown follows whichever ends first), greedy valid BLEU every 1000 steps (the
#      curve), then average (the count chosen on valid), translate valid, score valid; the
#      arm with the best mean valid sacreBLEU alone then translates and scores test2016.
#      An arm that sets the data stages (data.*, vocab.*, survey.*, shard.*: e.g. the
#      vocabulary's size) trains on data that `prepare` built for it with those settings
#      (.gpu/m30k8k-<arm>, and -deen for part 11; ~10 MB of the carry's 64 MiB for the
#      two); the others share .gpu/m30k8k.
# Results: $OUT/session.log, $OUT/results.tar.gz (parts 5 and 6: JSON records, run folders'
# params.yaml, run.log and metrics/), and for parts 1-4, $OUT/gpu_step_*.json, $OUT/m30k.tar.gz (metrics/, params.yaml),
# $OUT/screen/<arm>-s<seed>/ (params.yaml, run.log, metrics/).
# About 10 minutes on an H200 (the machine's start not counted); PARTS="1c 1d 2 3" MINUTES=2
# took 7 minutes (docs/results/gpu-h200/2026-11-26-loss-blocks); PARTS=4 with 12 runs of 1750 steps
# 3.5 minutes (2026-11-27-recipe-screen). The default shape screen, 15 runs of 1280-2520 steps, is 1.4x
# that screen's steps in all: by that rate about 5 minutes, not yet run (7 at most: the guard).
set -u
STEPS=${STEPS:-4000}
MINUTES=${MINUTES:-3}
PY=${PY:-python3}
M30K=${M30K:-../shared/data/multi30k}  # the corpus (prepare only): {train,val,test2016}.{en,de}
PARTS=${PARTS:-"1 2 3"}                 # which parts to run: "1 2 3", or sub-parts ("1c 1d 3")
WORK=${WORK:-.gpu/m30k}                 # part 3's folder
# part 4: "name:KEY=VALUE KEY=VALUE;name:..." (an arm without settings is the preset itself;
# an arm's own train.steps overrides SCREEN_STEPS). The default: model shapes, each trained
# for the steps the AVX2-only CPU's hour holds at that shape's speed. SCREEN_STEPS x the
# shape's target tokens/s over the preset's, measured side by side on that CPU
# (bench.train_throughput --arm, two runs, bench/README.md): d_ff 512 1.17-1.18x,
# 2+2 layers 1.28x, d 192 (3 heads, d_ff 768) 1.40-1.48x, d 320 (5 heads, d_ff 1280)
# 0.71-0.75x. The recipe screen of 2026-11-27 (docs/results/gpu-h200/) set SCREEN to arms of
# train.* settings at SCREEN_STEPS, e.g. "preset:;dropout0.1:model.dropout=0.1".
SCREEN=${SCREEN:-"preset:;ff512:model.d_ff=512 train.steps=2055;l2:model.encoder_layers=2 model.decoder_layers=2 train.steps=2240;d192:model.d_model=192 model.heads=3 model.d_ff=768 train.steps=2520;d320:model.d_model=320 model.heads=5 model.d_ff=1280 train.steps=1280"}
SEEDS=${SEEDS:-"1 2 3"}
SCREEN_STEPS=${SCREEN_STEPS:-1750}      # the AVX2-only CPU's hour: steps 1683-1750 (2026-11-26/27)
SCREEN_MINUTES=${SCREEN_MINUTES:-7}     # a guard only: the steps end each run first
PART5_SECONDS=${PART5_SECONDS:-190}     # part 5's deadline, all its runs together
PART7_SECONDS=${PART7_SECONDS:-330}     # part 7's
PART10_SECONDS=${PART10_SECONDS:-500}   # part 10's
# part 6: arms as SCREEN's ("name:KEY=VALUE ..."), on top of the preset with 8k-token steps
# The first screen (2026-11-28-micro-batch-dropout: "d0.2:;d0.3:model.dropout=0.3") chose dropout 0.3 on valid;
# the next one regularises further or widens the model, all at dropout 0.3 or more, and
# offers averages of up to 30 checkpoints (all four runs of 2026-11-28 took the widest, 20).
# v10k: dropout 0.3 with the vocabulary of the published 41.02 (Wu et al. 2021: 10k BPE
# merges; here byte-level, so 256 bytes + 4 specials + 10,000 merges), on its own data.
# The published recipe whole (Transformer-tiny at peak lr 0.005; it lost on the AMX CPU at
# 28M tokens, still underfitting) is one arm away, if CONV_MINUTES lets it reach its 8,000
# steps: "wu:model.d_model=128 model.d_ff=256 model.encoder_layers=4 model.decoder_layers=4
# model.dropout=0.3 train.warmup_steps=2000 train.lr_scale=2.53 vocab.vocab_size=10260".
# rdrop: the multi30k_rdrop preset (R-Drop, alpha 5, at the preset's dropout 0.2): valid
# 42.08 and test2016 41.31 / 41.73 lc-tok over 2 seeds in the AMX CPU hour at 17-18M tokens
# (docs/results/multi30k/bf16-amx-rdrop/); its step costs ~2x, so it sees fewer steps here.
CONV=${CONV:-"rdrop:train.rdrop=5;d0.3:model.dropout=0.3;reg:model.dropout=0.3 train.attention_dropout=0.1 train.activation_dropout=0.1 train.subword_split=0.1;wide:model.d_model=512 model.heads=8 model.d_ff=2048 model.dropout=0.4;v10k:model.dropout=0.3 vocab.vocab_size=10260"}
CONV_AVERAGE=${CONV_AVERAGE:-"[1,5,10,20,30]"}
CONV_SEEDS=${CONV_SEEDS:-"1 2"}
CONV_STEPS=${CONV_STEPS:-8000}          # the published recipe's 8,000 updates of ~8k tokens
CONV_MINUTES=${CONV_MINUTES:-4}         # each run's time budget (validation included)
TABLE3_MINUTES=${TABLE3_MINUTES:-5}     # part 8: each of Table 3's rows, side by side
DECODE_MODEL=${DECODE_MODEL:-}          # part 9 (prepare): a model folder to carry
# part 9 (prepare): the decoders before the grouped state (055b2b1) and before bf16 weights (0b24f1f)
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
    # be packed with this run's; the carry holds 64 MiB in all, DECODE_MODEL ~30 MB of it)
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
# part 10 is not a sub-part of part 1)
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
if want 1b; then
part "1b. the same for base with cuDNN attention left in SDPA's choice (the baseline)"
timeout 60 $PY -m bench.gpu_step --configs base --warmup 3 --steps 8 --cudnn-attention \
    --json "$OUT/gpu_step_cudnn.json" || echo "PART 1b FAILED ($?)"
fi
if want 1c; then
part "1c. base on shapes met before (--reuse), first and last step profiled"
timeout 120 $PY -m bench.gpu_step --configs base --warmup 30 --steps 10 --reuse --profile \
    --json "$OUT/gpu_step_reuse.json" | grep -v "^USDT"
rc=${PIPESTATUS[0]}  # the benchmark's status, not grep's
[ "$rc" -eq 0 ] || echo "PART 1c FAILED ($rc)"
fi
if want 1d; then
part "1d. the same shapes with the loss in the CPU's 256-row blocks (the baseline of loss_blocks)"
timeout 90 $PY -m bench.gpu_step --configs base --warmup 30 --steps 10 --reuse --cpu-loss-blocks \
    --json "$OUT/gpu_step_cpu_loss_blocks.json" || echo "PART 1d FAILED ($?)"
fi
if want 1e; then
part "1e. base on shapes met before: weights cast once per step (default) / per micro-batch, ABAB"
for round in 1 2; do
    for how in step batch; do
        flag=(); [ "$how" = batch ] && flag=(--cast-per-batch)
        timeout 60 $PY -m bench.gpu_step --configs base --warmup 20 --steps 10 --reuse "${flag[@]}" \
            --json "$OUT/gpu_step_cast_${how}_$round.json" || echo "PART 1e FAILED ($?)"
    done
done
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
RES=$PWD/.gpu/out  # parts 5 and 6 write here; packed into $OUT/results.tar.gz after each
mkdir -p "$RES"
pack() { tar czf "$OUT/results.tar.gz" -C "$RES" . 2>/dev/null; }

step_run() {  # $1: the JSON's name, $2: the seconds it may take at most; the rest: arguments
    # (the part's $deadline and $label set by the part)
    local name=$1 limit=$2 left=$((deadline - SECONDS)); shift 2
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 15 ]; then echo "PART $label SKIPPED $name: the part's deadline"; return; fi
    local run=($PY)
    case " $* " in *" --ddp "*) run=($PY -m torch.distributed.run --standalone --nproc-per-node 1);; esac
    timeout "$limit" "${run[@]}" -m bench.gpu_step --configs base,big --count-kernels "$@" \
        --json "$RES/gpu_step_$name.json" || echo "PART $label FAILED $name ($?)"
}

if want 5; then
part "5. micro-batch size: 4 x 6250 against 1 x 25000 (eager, ABAB), then 1 x 25000 compiled"
deadline=$((SECONDS + PART5_SECONDS)) label=5
for round in 1 2; do
    step_run "mb6250_$round" 50 --warmup 3 --steps 8 --max-tokens 6250
    step_run "mb25000_$round" 50 --warmup 3 --steps 8 --max-tokens 25000 \
        $([ "$round" = 2 ] && echo --profile)  # where the time goes, in the log
done
step_run mb25000_ddp 60 --warmup 3 --steps 8 --max-tokens 25000 --ddp  # torchrun, NCCL
step_run mb25000_compile 150 --warmup 6 --steps 8 --max-tokens 25000 --compile --configs base
pack
fi

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

if want 10; then
part "10. repeated batch shapes: widths to multiples of 8, decoder unpacked, shapes met before; ABAB against today's; compiled"
deadline=$((SECONDS + PART10_SECONDS)) label=10
shapes=(--max-tokens 25000 --no-packing --warm-shapes)
for round in 1 2; do
    step_run "today_$round" 50 --warmup 3 --steps 8 --max-tokens 25000
    step_run "pad8_$round" 70 --warmup 3 --steps 8 "${shapes[@]}" --pad-multiple 8
    step_run "int16drop_$round" 50 --warmup 3 --steps 8 --max-tokens 25000 --int16-dropout
done
step_run pad1_warm 70 --warmup 3 --steps 8 "${shapes[@]}"
step_run pad8_compile 120 --configs base --warmup 6 --steps 8 "${shapes[@]}" --pad-multiple 8 --compile
step_run pad8_graphs 150 --configs base --warmup 6 --steps 8 "${shapes[@]}" --pad-multiple 8 \
    --compile --compile-mode reduce-overhead
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
# de->en (issue 45): the arm part 6 chose on en->de valid (its record; DEEN_ARM overrides),
# each of CONV_SEEDS with source and target swapped, side by side, then test2016
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
